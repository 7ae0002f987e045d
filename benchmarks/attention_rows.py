"""The kernels' attention alone (`kernels.attention_rows`): R new rows of a chain over C cached
slots, for a model's head shapes, with as many layers' caches as the model has, read in turn so
that keys and values come from memory as in a forward (one layer's cache of a few thousand
slots would stay in L2). Microseconds a layer, medians, a markdown table.

    python benchmarks/attention_rows.py [--heads 9 --kv-heads 3 --head-dim 64 --layers 30]
        [--contexts 1024 2048 4096] [--rows 1 4 8 16] [--dtype bfloat16]

SmolLM2-135M's shapes are the default; Gemma-3-270M's are `--heads 4 --kv-heads 1 --head-dim
256 --layers 18`. The visible lists are checked and the attention plan is built in every
call (a forward builds them once for all its layers), so small calls cost more here than in a
forward.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from specfork.kernels import load_kernels

log = logging.getLogger("attention_rows")


def chain_lists(context: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, off) of `rows` rows after `context` slots, each seeing the prefix and itself."""
    idx = torch.cat([torch.arange(context + r + 1, dtype=torch.int32) for r in range(rows)])
    off = torch.tensor([0] + [sum(context + q + 1 for q in range(r + 1)) for r in range(rows)])
    return idx, off


def layer_us(kernels, args: argparse.Namespace, context: int, rows: int) -> float:
    """Median µs of one layer's attention of `rows` rows after `context` slots."""
    dtype = getattr(torch, args.dtype)
    shape = (args.kv_heads, context + rows, args.head_dim)  # [H_kv, S, D]
    g = torch.Generator().manual_seed(0)
    caches = [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(args.layers)
    ]
    q = torch.randn(rows, args.heads, args.head_dim, generator=g)  # [R, H, D]
    idx, off = chain_lists(context, rows)
    scale = args.head_dim**-0.5
    times = []
    for repeat in range(args.repeats + 1):
        t0 = time.perf_counter()
        for k, v in caches:
            kernels.attention_rows(q, k, v, idx, off, scale)
        if repeat:  # the first pass warms up
            times.append((time.perf_counter() - t0) / args.layers)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the kernels cannot be built here: nothing to measure")
    shape = f"heads {args.heads}/{args.kv_heads} of {args.head_dim}, {args.dtype} cache"
    log.info(
        "kernels %s, %d threads; %s, %d layers' caches in turn",
        kernels.isa(),
        kernels.threads(),
        shape,
        args.layers,
    )
    log.info("| context | " + " | ".join(f"{r} rows" for r in args.rows) + " |")
    log.info("|---|" + "---|" * len(args.rows))
    for context in args.contexts:
        cells = " | ".join(f"{layer_us(kernels, args, context, r):.0f} µs" for r in args.rows)
        log.info("| %d | %s |", context, cells)


if __name__ == "__main__":
    main()
