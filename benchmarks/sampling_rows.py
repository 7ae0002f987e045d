"""Sampling one token from a vocabulary row: `specfork.sampling` (PyTorch ops) against the
kernels (`kernels.sample_rows`), in a warm loop, medians.

    python benchmarks/sampling_rows.py --vocab 49152 --repeats 200
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch

from specfork.config import SamplingParams
from specfork.kernels import load_kernels
from specfork.kernels.sample_rows import fast_probabilities, fast_sample
from specfork.sampling import probabilities, sample

log = logging.getLogger("sampling_rows")

SETTINGS = {
    "temperature 0.7": SamplingParams(temperature=0.7),
    "top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top-k 40": SamplingParams(temperature=0.7, top_k=40),
}


def median_us(draw: Callable[[], object], repeats: int) -> float:
    """Median microseconds of `draw()` over `repeats` calls after one warm-up call."""
    draw()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        draw()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if load_kernels() is None:
        raise SystemExit("the kernels cannot be built here: nothing to compare")
    logits = 3 * torch.randn(1, args.vocab, generator=torch.Generator().manual_seed(0))  # [1, V]
    gen = torch.Generator().manual_seed(0)
    log.info("| row | PyTorch µs | kernels µs |")
    log.info("|---|---|---|")
    for name, params in SETTINGS.items():
        slow = median_us(lambda p=params: sample(probabilities(logits, p)[0], gen), args.repeats)
        fast = median_us(
            lambda p=params: fast_sample(fast_probabilities(logits, p)[0], gen), args.repeats
        )
        log.info("| %s | %.0f | %.0f |", name, slow, fast)


if __name__ == "__main__":
    main()
