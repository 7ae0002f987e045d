"""Bigger targets on specfork's kernels and on llama.cpp: random-weight GGUFs of real shapes.

Writes random-weight Llama GGUFs (TinyLlama-1.1B's layout; `--sizes 1b,3b` adds Llama-3.2-3B's)
in Q4_K_M's block mix (Q4_K, Q6_K for attn_v, ffn_down and the output) and in Q8_0, then
times one forward of R new rows (the verification curve, R = 1-32) after a short context and a
4k-token one on the kernels at the file's own precision; with `--llama-bench PATH`, llama.cpp's
`llama-bench` on the same files (tg: one row per step; pp R: a batch of R rows; `-d` for the
long context). Medians; a markdown table of milliseconds per forward.

    python benchmarks/big_targets.py [--sizes 1b] [--mixes Q4_K_M,Q8_0] \
        [--contexts 256,4096] [--llama-bench PATH] [--repeats 5] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import tempfile
import time
from pathlib import Path

from cost_curve import ROWS, forward_ms  # benchmarks/: the same timing as the cost curve

from specfork.bench.random_gguf import SHAPES, write_random_llama
from specfork.kernels import load_kernels
from specfork.loading.fast import load_gguf_fast

log = logging.getLogger("big_targets")


def llama_bench(binary: Path, path: Path, context: int, repeats: int) -> dict[int, float]:
    """llama-bench's ms per forward of R rows: tg (R = 1) and pp R, after `context` tokens
    (each of its tests prefills the context again: past 512 tokens, one repeat)."""
    cmd = [
        str(binary),
        "-m",
        str(path),
        "-t",
        "2",
        "-r",
        str(repeats if context <= 512 else 1),
        "-o",
        "json",
        "-n",
        "16",
        "-p",
        ",".join(str(r) for r in ROWS[1:]),
        "-d",
        str(context),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    # tokens per second of each test: a forward of R rows takes R / avg_ts seconds
    return {
        test["n_prompt"] or 1: 1e3 * (test["n_prompt"] or 1) / test["avg_ts"]
        for test in json.loads(out)
    }


def row(name: str, ms: dict[int, float]) -> str:
    cells = " | ".join(f"{ms[r]:.1f} ms ({ms[r] / ms[1]:.2f}×)" if r in ms else "—" for r in ROWS)
    return f"| {name} | {cells} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1b", help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--mixes", default="Q4_K_M,Q8_0")
    ap.add_argument("--contexts", default="256,4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench binary")
    ap.add_argument("--keep", type=Path, help="write the GGUFs here and keep them")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the kernels cannot be built here")
    contexts = [int(c) for c in args.contexts.split(",")]
    folder = args.keep or Path(tempfile.mkdtemp(prefix="big-targets-"))
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["| target | " + " | ".join(f"{r} rows" for r in ROWS) + " |", "|---|" + "---|" * 6]
    for size in args.sizes.split(","):
        shape = SHAPES[size]
        for mix in args.mixes.split(","):
            path = folder / f"random-{shape.name}-{mix}.gguf"
            if not path.exists():
                log.info("writing %s (%.2fB parameters)", path.name, shape.parameters() / 1e9)
                write_random_llama(path, shape, mix)
            size_mb = path.stat().st_size / 1e6
            t0 = time.perf_counter()
            model = load_gguf_fast(path, kernels)
            log.info("%s: %.0f MB, packed in %.1f s", path.name, size_mb, time.perf_counter() - t0)
            for context in contexts:
                ms = forward_ms(model, context, args.repeats)
                lines.append(row(f"{shape.name} {mix}, specfork, context {context}", ms))
                log.info(lines[-1])
                if args.llama_bench is not None:
                    lines.append(
                        row(
                            f"{shape.name} {mix}, llama-bench, context {context}",
                            llama_bench(args.llama_bench, path, context, args.repeats),
                        )
                    )
                    log.info(lines[-1])
            del model
    print("\n".join(lines))


if __name__ == "__main__":
    main()
