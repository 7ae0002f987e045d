"""A/B of one batched decoding step on the eager path (`--kernels off`, CUDA): the sequences
one after another (what `DecoderLM.forward_batch` did before it packed them) against the packed
`forward_batch`, interleaved, medians of 10 timed repeats after 2 warm-ups.

    python benchmarks/packed_batch_ab.py [--dtype float32] [--device cpu] [--batches 4,16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from specfork.kv_cache import KVCache
from specfork.loading.loader import load_model
from specfork.models.base import DecoderLM, Segment

PREFIX = 200  # tokens in each sequence's cache before the timed step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _caches(model: DecoderLM, batch: int) -> list[KVCache]:
    caches = []
    for _ in range(batch):
        cache = model.new_cache(512)
        model.extend(torch.randint(100, 40000, (PREFIX,)).tolist(), cache)
        caches.append(cache)
    return caches


def _segments(caches: list[KVCache], device: torch.device) -> list[Segment]:
    return [
        Segment(torch.tensor([300 + i], device=device), torch.tensor([c.length], device=device), c)
        for i, c in enumerate(caches)
    ]


def compare(model: DecoderLM, batch: int, repeats: int = 12) -> tuple[float, float]:
    """Median seconds of a one-row step for `batch` sequences: one after another, packed."""
    caches, device = _caches(model, batch), model.device

    def apart() -> None:
        for s in _segments(caches, device):
            model.forward_capturing(s.tokens[None], s.positions, s.cache, s.mask)

    def packed() -> None:
        model.forward_batch(_segments(caches, device))

    times: dict[str, list[float]] = {"apart": [], "packed": []}
    runs: list[tuple[str, Callable[[], None]]] = [("apart", apart), ("packed", packed)]
    with torch.inference_mode():
        for rep in range(repeats):
            for name, run in runs if rep % 2 else runs[::-1]:
                _sync(device)
                start = time.perf_counter()
                run()
                _sync(device)
                times[name].append(time.perf_counter() - start)
                for cache in caches:
                    cache.truncate(PREFIX)
    return statistics.median(times["apart"][2:]), statistics.median(times["packed"][2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="4,16")
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model(
        "smollm2-135m-instruct", dtype=args.dtype, device=args.device, kernels=False,
        progress=False,
    )  # fmt: skip
    for batch in (int(b) for b in args.batches.split(",")):
        apart, packed = compare(loaded.model, batch)
        print(
            f"{args.dtype} {args.device}, {batch} sequences: one after another "
            f"{apart * 1e3:.1f} ms, packed {packed * 1e3:.1f} ms, {apart / packed:.2f}×"
        )


if __name__ == "__main__":
    main()
