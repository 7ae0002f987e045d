"""Configuration dataclasses, validated on construction.

`ModelConfig` describes a decoder architecture (filled from a GGUF header or a Hugging Face
`config.json`); `SamplingParams` and `GenerationConfig` describe one request.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from specfork.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")
ARCHITECTURES = ("llama", "gemma3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters for one group of layers.

    `rope_type` follows transformers' names: "default" (none), "linear", "llama3", "dynamic"
    (identical to none up to the original context, which is as far as specfork runs it) and
    "yarn".
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    freq_factors: tuple[float, ...] | None = None  # per-frequency divisors (GGUF rope_freqs)

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"RoPE scaling type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(ROPE_TYPES)}"
            )
        if not (self.theta > 0 and math.isfinite(self.theta)):
            raise ConfigError(f"rope theta must be a positive number, got {self.theta}")
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be positive, got {self.factor}")
        needs_original = self.rope_type in ("llama3", "yarn")
        if needs_original and self.original_max_position is None:
            raise ConfigError(
                f"RoPE scaling {self.rope_type!r} needs original_max_position_embeddings"
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder-only transformer, in the vocabulary of transformers' configs."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    max_position: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_local: RopeConfig | None = None  # sliding-window layers' RoPE (Gemma 3)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # "full" or "sliding" per layer; () = all full
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.arch!r} is not supported; supported: "
                f"{', '.join(ARCHITECTURES)} (Llama 2/3, SmolLM, Mistral, Qwen2/2.5/3, Gemma 3)"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model config {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a positive multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be even and >= 2, got {self.head_dim}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ConfigError(f"activation {self.hidden_act!r} is not supported")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        if any(t not in ("full", "sliding") for t in self.layer_types):
            raise ConfigError(f"layer types must be 'full' or 'sliding', got {self.layer_types}")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ConfigError("sliding layers need a sliding_window size")

    def to_dict(self) -> dict:
        """A JSON-ready dict; `ModelConfig.from_dict` reverses it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        def rope(r: dict | None) -> RopeConfig | None:
            if r is None:
                return None
            factors = r.get("freq_factors")
            return RopeConfig(**{**r, "freq_factors": tuple(factors) if factors else None})

        return cls(
            **{**d, "rope": rope(d["rope"]), "rope_local": rope(d.get("rope_local")),
               "layer_types": tuple(d.get("layer_types", ()))}
        )  # fmt: skip

    def layer_type(self, index: int) -> str:
        """'full' or 'sliding' for layer `index`."""
        if self.layer_types:
            return self.layer_types[index]
        return "sliding" if self.sliding_window else "full"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a token is chosen from logits. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        seed = self.seed
        if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """Limits and stop conditions of one request."""

    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if not _is_int(n) or n < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {n}")
        if isinstance(self.stop, str):  # one stop string, as the OpenAI API allows
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ConfigError("stop strings must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"stop token ids must be integers >= 0, got {self.stop_token_ids}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


STRATEGIES = ("ar", "speculative")
POLICY_NAMES = ("constant", "heuristic", "linear-decay")
DRAFTERS = ("ngram", "self", "model:PATH")


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Which decoding strategy runs and how it drafts.

    strategy "ar" is plain decoding. "speculative" drafts with `drafter`: "ngram" (prompt
    lookup), "self" (the target's own layers: `self_layers` for early exit, e.g. "0-11", or
    `skip_layers`), or "model:PATH" (a separate draft model sharing the target's vocabulary).
    `k` is the draft length (the maximum for linear-decay); `k_policy` the draft-length policy.
    """

    strategy: str = "ar"
    drafter: str = "ngram"
    k: int = 5
    k_policy: str = "constant"
    self_layers: str | None = None
    skip_layers: str | None = None
    max_ngram: int = 3
    min_ngram: int = 1
    expected_length: int = 256  # T of the linear-decay policy

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}"
            )
        if not isinstance(self.drafter, str) or (
            self.drafter not in ("ngram", "self") and not self.drafter.startswith("model:")
        ):
            raise ConfigError(
                f"unknown drafter {self.drafter!r}; choose one of {', '.join(DRAFTERS)}"
            )
        if not _is_int(self.k) or self.k < 1:
            raise ConfigError(f"k (draft length) must be an integer >= 1, got {self.k}")
        if self.k_policy not in POLICY_NAMES:
            raise ConfigError(
                f"unknown draft-length policy {self.k_policy!r}; "
                f"choose one of {', '.join(POLICY_NAMES)}"
            )
        for name in ("max_ngram", "min_ngram", "expected_length"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)}")
        if self.min_ngram > self.max_ngram:
            raise ConfigError(
                f"min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})"
            )
        if self.self_layers and self.skip_layers:
            raise ConfigError("give either self_layers (early exit) or skip_layers, not both")
