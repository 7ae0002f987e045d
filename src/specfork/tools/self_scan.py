"""Which of its own layers should a model draft with? Measure a few candidate subsets.

Each candidate (early exit after a fraction of the layers, or skipping a block of middle
layers) drafts greedily for a few sample prompts; we report its acceptance rate, tokens per
target forward and decode speed next to plain decoding, so a user can pick `--self-layers` or
`--skip-layers` from numbers rather than guesses.
"""

from __future__ import annotations

from dataclasses import dataclass

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.generator import Generator
from specfork.loading.loader import LoadedModel

SAMPLE_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize: The city council met on Tuesday to discuss the new park. The park will have a "
    "playground, a pond and walking paths. The council approved the budget for the park.",
)


@dataclass(frozen=True, slots=True)
class ScanRow:
    """One candidate's measured figures over the sample prompts."""

    flag: str  # the CLI flag that selects it, e.g. "--skip-layers 10-19"
    acceptance_rate: float
    mean_accepted_length: float
    decode_tokens_per_second: float
    speedup: float  # over plain decoding in the same scan


def candidate_flags(num_layers: int) -> list[tuple[str, SpecConfig]]:
    """Early exits at 1/4, 1/2, 3/4 depth and skips of the middle third / half, each drafting
    K = 4 tokens ungated: a goodput gate would trim or skip drafts by timed costs, so the
    acceptance figures would depend on the machine's speed rather than on the layers."""
    n = num_layers
    out: list[tuple[str, SpecConfig]] = []
    for frac in (0.25, 0.5, 0.75):
        layers = f"0-{max(0, round(n * frac) - 1)}"
        out.append((f"--self-layers {layers}", _fixed_k(self_layers=layers)))
    for lo, hi in ((n // 3, 2 * n // 3 - 1), (n // 4, 3 * n // 4 - 1)):
        out.append((f"--skip-layers {lo}-{hi}", _fixed_k(skip_layers=f"{lo}-{hi}")))
    return out


def _fixed_k(**layers: str) -> SpecConfig:
    return SpecConfig("speculative", "self", k=4, goodput=False, **layers)


def scan_self_layers(
    loaded: LoadedModel, prompts: tuple[str, ...] = SAMPLE_PROMPTS, max_new_tokens: int = 64
) -> list[ScanRow]:
    """Measure each candidate subset against plain decoding on the same prompts (greedy)."""
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    plain = Generator(loaded)
    base_tps = _decode_rate(plain, prompts, config)[2]
    rows = []
    for flag, spec in candidate_flags(loaded.config.num_layers):
        acc, mal, tps = _decode_rate(Generator(loaded, spec=spec), prompts, config)
        rows.append(ScanRow(flag, acc, mal, tps, tps / base_tps if base_tps else 0.0))
    return rows


def _decode_rate(
    gen: Generator, prompts: tuple[str, ...], config: GenerationConfig
) -> tuple[float, float, float]:
    drafted = accepted = tokens = forwards = 0
    seconds = 0.0
    for prompt in prompts:
        s = gen.generate(prompt, config=config).stats
        drafted, accepted = drafted + s.drafted, accepted + s.accepted
        tokens, forwards = tokens + max(s.new_tokens - 1, 0), forwards + s.target_forwards
        seconds += s.decode_seconds
    return (
        accepted / drafted if drafted else 0.0,
        tokens / forwards if forwards else 0.0,
        tokens / seconds if seconds else 0.0,
    )
