"""Configuration dataclasses, validated on construction.

`ModelConfig` describes a decoder architecture (filled from a GGUF header or a Hugging Face
`config.json`); `SamplingParams` and `GenerationConfig` describe one request.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from specfork.catalog.kinds import (
    CHAIN_DRAFTERS,
    STRATEGY_NAMES,
    TREE_SOURCES,
    StrategyKind,
    strategy_kind,
)
from specfork.catalog.sources import DraftSource, parse_drafter
from specfork.checks import is_int, is_number
from specfork.constraint import Constraint
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
            raise ConfigError(f"rope theta must be a positive number, got {self.theta!r}")
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be positive, got {self.factor!r}")
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
                raise ConfigError(f"model config {name} must be >= 1, got {getattr(self, name)!r}")
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a positive multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be even and >= 2, got {self.head_dim!r}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ConfigError(f"activation {self.hidden_act!r} is not supported")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        if any(t not in ("full", "sliding") for t in self.layer_types):
            raise ConfigError(f"layer types must be 'full' or 'sliding', got {self.layer_types!r}")
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
            **{
                **d,
                "rope": rope(d["rope"]),
                "rope_local": rope(d.get("rope_local")),
                "layer_types": tuple(d.get("layer_types", ())),
            }
        )

    @property
    def embedding_scale(self) -> float:
        """What embedding rows are multiplied by: sqrt(hidden) for Gemma 3, else 1."""
        return self.hidden_size**0.5 if self.arch == "gemma3" else 1.0

    def layer_type(self, index: int) -> str:
        """'full' or 'sliding' for layer `index`."""
        if self.layer_types:
            return self.layer_types[index]
        return "sliding" if self.sliding_window else "full"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a token is chosen from logits. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off (-1, vLLM's "off", is taken as 0)
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    # OpenAI's penalties on the output so far: logit[t] -= frequency · c[t] + presence · (c[t] > 0),
    # c[t] = how often the output holds t; and fixed biases added to the logits of token ids.
    # They change the target's distribution, which speculation then reproduces exactly.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])

    def __post_init__(self) -> None:
        self._check_penalties()
        t = self.temperature
        if not is_number(t) or not math.isfinite(t) or t < 0:
            raise ConfigError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if is_int(self.top_k) and self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not is_int(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p!r}")
        seed = self.seed
        if seed is not None and (not is_int(seed) or not 0 <= seed < 2**63):
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {seed!r}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -2 <= value <= 2):
                raise ConfigError(f"{name} must be a number in [-2, 2], got {value!r}")
        bias = self.logit_bias
        if isinstance(bias, dict):  # {id: bias}, as OpenAI's JSON has it
            object.__setattr__(self, "logit_bias", bias := tuple(sorted(bias.items())))
        if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
            raise ConfigError(
                f"logit_bias must be at most {MAX_LOGIT_BIAS} (token id, bias) pairs, got {bias!r}"
            )
        for pair in bias:
            ok = isinstance(pair, tuple) and len(pair) == 2 and is_int(pair[0]) and pair[0] >= 0
            if not ok or not (_is_number(pair[1]) and -100 <= pair[1] <= 100):
                raise ConfigError(
                    f"logit_bias pairs are (token id >= 0, bias in [-100, 100]), got {pair!r}"
                )
        if len({t for t, _ in bias}) != len(bias):
            raise ConfigError("logit_bias names a token id twice")

    @property
    def penalized(self) -> bool:
        """Whether the target's logits change before sampling (penalties or biases)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW are greedy (as in vLLM): dividing float32 logits by
        a smaller one overflows, and the distribution is one-hot to float32 precision anyway."""
        return self.temperature < GREEDY_BELOW


MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit)
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's limit)


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """Limits and stop conditions of one request."""

    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    exact: bool = False  # demand output bitwise equal to plain decoding (batch-invariant steps)
    max_seconds: float | None = None  # decoding time limit (finish reason "time"); None: none
    logprobs: int | None = None  # None: no log-probabilities; n: the emitted token's and top n
    # the output must match it (JSON schema, any JSON object, regex); its end ends the output
    constraint: Constraint | None = None
    # the mean milliseconds the constraint may take to mask one row (None: no limit); a grammar
    # over it is refused at its first mask, or ends the request when it grows dear later
    max_mask_ms: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.exact, bool) or not isinstance(self.ignore_eos, bool):
            raise ConfigError("exact and ignore_eos must be true or false")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ConfigError(
                "constraint must be a specfork.Constraint (Constraint.json_schema(...), "
                f".json_object() or .regex(...)), got {type(self.constraint).__name__}"
            )
        for name in ("max_seconds", "max_mask_ms"):
            t = getattr(self, name)
            if t is not None and not (_is_number(t) and t > 0):
                raise ConfigError(f"{name} must be a number > 0 (or None), got {t!r}")
        n = self.logprobs
        if n is not None and not (is_int(n) and 0 <= n <= MAX_LOGPROBS):
            raise ConfigError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (or None), got {n!r}"
            )
        n = self.max_new_tokens
        if not is_int(n) or n < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        if isinstance(self.stop, str):  # one stop string, as the OpenAI API allows
            object.__setattr__(self, "stop", (self.stop,))
        for name, kind in (("stop", "stop strings"), ("stop_token_ids", "stop token ids")):
            value = getattr(self, name)
            if value is None:  # none, as OpenAI's `"stop": null`
                value = ()
            if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
                raise ConfigError(f"{name} must be a list of {kind}, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ConfigError("stop strings must be non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"stop token ids must be integers >= 0, got {self.stop_token_ids!r}")


def _is_number(x: object) -> bool:
    return is_number(x) and math.isfinite(x)


STRATEGIES = STRATEGY_NAMES  # ar, speculative, dspark, spork (catalog.kinds)
TREE_SHAPES = ("forks", "dynamic")
SPORK_SOURCES = TREE_SOURCES  # recycle, ngram, suffix, self, head[:PATH], model:PATH
POLICY_NAMES = ("constant", "heuristic", "linear-decay")
# SpecConfig's on/off options (checked to be true or false)
BOOL_OPTIONS = (
    "goodput",
    "payback",
    "cascade",
    "grammar_drafts",
    "adapt",
    "recycle_persist",
    "recycle_prior",
    "lossy_typical",
)
DRAFTERS = CHAIN_DRAFTERS  # ngram, suffix, self, head[:PATH], model:PATH


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Which decoding strategy runs and how it drafts.

    strategy "ar" is plain decoding. "speculative" drafts with `drafter`: "ngram" (prompt
    lookup), "suffix" (a suffix index of this and earlier requests), "self" (the target's
    own layers: `self_layers` for early exit, e.g. "0-11", or `skip_layers`), "head[:PATH]"
    (a trained draft head) or "model:PATH" (a separate draft model sharing the target's
    vocabulary), or several joined by "+" (asked in order; the first draft wins); `sources`
    is the drafter parsed (`catalog.sources`). `k` is the draft length (the maximum for
    linear-decay); `k_policy` the draft-length policy.

    "dspark" drafts with the same drafters but re-chooses K every round from a confidence
    C = (w_top1·top1 + w_margin·min(margin_scale·margin, 1) + w_ema·EMA) / Σw, mapped linearly
    from [low, high] onto [min_k, max_k] (see `specfork.strategies.dspark`).

    "spork" drafts a tree and verifies it in one pass (see `specfork.strategies.spork`):
    `drafter` is one or more sources joined by "+" ("recycle", "ngram", "suffix", "self",
    "head[:PATH]", "model:PATH"); `tree` "forks" is `forks` forks × `depth` tokens,
    "dynamic" the `budget` best nodes up to `depth` deep; nodes whose prior score is below
    `tau` are not verified; forks, depth and tau adapt toward `target_acceptance` when
    `adapt`. `lossy_typical` swaps exact verification for Medusa's typical acceptance (LOSSY:
    the output may differ from plain decoding).

    `goodput` (chains: speculative and dspark) verifies only as much of each draft as its
    source's acceptance so far says will pay for the extra rows (see
    `specfork.strategies.goodput`); it never changes the output. With it, `payback` checks the
    gate by the clock: a lone request whose drafting rounds emit fewer tokens per second than
    plain rounds stops drafting for a while (`specfork.engine.payback`). `cascade` (chains)
    turns a drafter of free sources and a head ("ngram+head", "suffix+head") into a cascade:
    the free sources' chain is checked and extended by the head (`drafters.cascade`).
    `grammar_drafts`: a constrained request (JSON schema, regex, a required tool call) of a
    drafting strategy also drafts the tokens its grammar forces (`engine.forced`).
    """

    strategy: str = "ar"
    drafter: str | None = None  # default: "recycle" for spork, "ngram" otherwise
    k: int = 16  # long: the goodput gate trims what would not pay (docs/benchmarks.md)
    k_policy: str = "constant"
    self_layers: str | None = None
    skip_layers: str | None = None
    max_ngram: int = 3
    min_ngram: int = 1
    expected_length: int = 256  # T of the linear-decay policy
    # DSpark's confidence schedule
    min_k: int = 2
    max_k: int = 16
    low: float = 0.3
    high: float = 0.7
    weights: tuple[float, float, float] = (0.4, 0.3, 0.3)  # top1, margin, EMA of acceptance
    ema_rate: float = 0.2
    margin_scale: float = 5.0
    # SPORK's tree
    forks: int = 4
    depth: int = 4
    tree: str = "forks"
    budget: int = 24
    tau: float = 0.0
    tau_max: float = 0.0  # the τ controller's upper bound is max(tau, tau_max)
    target_acceptance: float = 0.7
    adapt: bool = True
    recycle_persist: bool = False  # keep the recycle table across requests (Token Recycling)
    recycle_prior: bool = False  # start the table from the target's one-token predictions
    lossy_typical: bool = False
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    goodput: bool = True  # chains: verify only the part of a draft expected to pay (goodput.py)
    payback: bool = True  # stop drafting while drafting rounds lose to plain ones (payback.py)
    cascade: bool = False  # chains: the free sources' chain checked and extended by the head
    grammar_drafts: bool = True  # a constrained request drafts the tokens its grammar forces
    # `drafter` parsed once in __post_init__ (`sources`): not an option, not compared or hashed
    _sources: tuple[DraftSource, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kind = strategy_kind(self.strategy)
        if self.drafter is None:
            object.__setattr__(self, "drafter", kind.default_drafter)
        object.__setattr__(self, "_sources", parse_drafter(self.drafter, kind))
        if not is_int(self.k) or self.k < 1:
            raise ConfigError(f"k (draft length) must be an integer >= 1, got {self.k!r}")
        if self.k_policy not in POLICY_NAMES:
            raise ConfigError(
                f"unknown draft-length policy {self.k_policy!r}; "
                f"choose one of {', '.join(POLICY_NAMES)}"
            )
        for name in ("max_ngram", "min_ngram", "expected_length"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.min_ngram > self.max_ngram:
            raise ConfigError(
                f"min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})"
            )
        for name in ("self_layers", "skip_layers"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} must be a layer list such as '0-11', got {value!r}")
        if self.self_layers and self.skip_layers:
            raise ConfigError("give either self_layers (early exit) or skip_layers, not both")
        self._check_layers_used()
        for name in BOOL_OPTIONS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._check_cascade()
        self._check_dspark()
        self._check_spork()

    def _check_cascade(self) -> None:
        """A cascade is free chain sources (ngram, suffix) followed by a head, for chains."""
        if not self.cascade:
            return
        if self.strategy_kind.tree:
            raise ConfigError(
                "cascade is for chain strategies (speculative, dspark); spork merges its "
                "sources into one tree: use strategy dspark or leave cascade out"
            )
        kinds = [source.kind for source in self._sources]
        if len(kinds) < 2 or kinds[-1] != "head" or set(kinds[:-1]) - {"ngram", "suffix"}:
            raise ConfigError(
                f"a cascade is free sources (ngram, suffix) checked by a head, written e.g. "
                f"ngram+head or suffix+ngram+head[:PATH]; got drafter {self.drafter!r}"
            )

    def _check_layers_used(self) -> None:
        """Layers are what the self drafter runs: given to another drafter they would be
        silently unused."""
        given = [n for n in ("self_layers", "skip_layers") if getattr(self, n) is not None]
        if given and not self.drafts_with("self"):
            plus = " (or add it: e.g. recycle+self)" if self.strategy_kind.tree else ""
            raise ConfigError(
                f"{given[0]} chooses the layers of the self drafter, but the drafter is "
                f"{self.drafter!r}; use drafter self{plus}, or leave {given[0]} out"
            )

    def _check_spork(self) -> None:
        for name in ("forks", "depth", "budget"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.tree not in TREE_SHAPES:
            raise ConfigError(f"unknown tree shape {self.tree!r}; choose one of forks, dynamic")
        if self.budget < self.depth:
            raise ConfigError(
                f"the node budget ({self.budget}) is smaller than the depth ({self.depth}); "
                "a budget must hold at least one whole fork"
            )
        if not (_is_number(self.tau) and 0 <= self.tau < 1):
            raise ConfigError(f"tau must be in [0, 1), got {self.tau!r}")
        if not (_is_number(self.tau_max) and 0 <= self.tau_max < 1):
            raise ConfigError(
                f"tau_max must be in [0, 1), got {self.tau_max!r}; it bounds how far the "
                "controller raises tau"
            )
        if not (_is_number(self.target_acceptance) and 0 < self.target_acceptance <= 1):
            got = self.target_acceptance
            raise ConfigError(f"target_acceptance must be in (0, 1], got {got!r}")
        if self.lossy_typical and not self.strategy_kind.tree:
            raise ConfigError("lossy typical acceptance is a SPORK option; use strategy spork")
        if not (_is_number(self.typical_epsilon) and 0 < self.typical_epsilon <= 1):
            raise ConfigError(f"typical_epsilon must be in (0, 1], got {self.typical_epsilon!r}")
        if not (_is_number(self.typical_delta) and self.typical_delta > 0):
            raise ConfigError(f"typical_delta must be > 0, got {self.typical_delta!r}")

    def _check_dspark(self) -> None:
        if not is_int(self.min_k) or self.min_k < 1:
            raise ConfigError(f"min_k must be an integer >= 1, got {self.min_k!r}")
        if not is_int(self.max_k) or self.max_k < self.min_k:
            got = self.max_k
            raise ConfigError(f"max_k must be an integer >= min_k ({self.min_k}), got {got!r}")
        low, high = self.low, self.high
        if not (_is_number(low) and _is_number(high) and low < high and high - low < math.inf):
            raise ConfigError(
                f"the confidence thresholds need low < high (finite numbers), got low={self.low}, "
                f"high={self.high}; the defaults are 0.3 and 0.7"
            )
        w = tuple(self.weights) if isinstance(self.weights, (tuple, list)) else (self.weights,)
        object.__setattr__(self, "weights", w)
        numbers = len(w) == 3 and all(_is_number(x) and x >= 0 for x in w)
        if not numbers or not 0 < sum(w) < math.inf:
            raise ConfigError(
                f"weights must be three numbers >= 0 (top1, margin, EMA) with a positive sum, "
                f"got {w!r}; the default is 0.4,0.3,0.3"
            )
        if not (_is_number(self.ema_rate) and 0 < self.ema_rate <= 1):
            raise ConfigError(f"ema_rate must be in (0, 1], got {self.ema_rate!r}")
        if not (_is_number(self.margin_scale) and self.margin_scale > 0):
            raise ConfigError(f"margin_scale must be a number > 0, got {self.margin_scale!r}")

    @property
    def sources(self) -> tuple[DraftSource, ...]:
        """`drafter` parsed: its sources in the order given (`str(source)` writes one back)."""
        return self._sources

    @property
    def strategy_kind(self) -> StrategyKind:
        """What `strategy` is (catalog.kinds): whether it drafts, chains or trees, ..."""
        return strategy_kind(self.strategy)

    @property
    def drafts(self) -> bool:
        """Whether the strategy drafts (every one but plain decoding, "ar")."""
        return self.strategy_kind.drafts

    def drafts_with(self, kind: str) -> bool:
        """Whether one of the drafter's sources is of `kind` ("self", "recycle", "model", ...)."""
        return any(source.kind == kind for source in self._sources)

    @property
    def draft_k(self) -> int:
        """The most tokens one round drafts (DSpark's max_k, SPORK's node budget); 0 if none."""
        longest = self.strategy_kind.longest
        return getattr(self, longest) if longest else 0

    def to_dict(self) -> dict:
        """The options as a JSON-ready dict (`SpecConfig(**d)` reverses it)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}
