"""Two versions' kernels side by side: milliseconds of one forward by context and new rows.

A kernel change shows in the cost of a forward long before it shows in decode tokens/s (which
mixes in the strategy, the prompt and Python). Each version runs in its own worker process
(PYTHONPATH = its `src` folder, so each builds and loads its own kernels), loads the default
model at its GGUF precision, fills a cache with `--contexts` tokens and times forwards of
`--rows` new rows over it (no LM head; the median of `--repeats` runs after a warm-up). The
workers take turns, `--rounds` times, so both see the same machine state; the table gives, per
(context, rows), the median over rounds of each version's median and the ratio B / A. It also
says whether both versions gave the same hidden states (they do when a change only moves work
around; a change of summation order makes them differ in the last bits).

    git worktree add /tmp/specfork-old <old commit>
    python benchmarks/forward_ab.py /tmp/specfork-old . --contexts 256,1024 --rows 1,5,8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import hashlib, json, statistics, sys, time
import torch
from specfork.loading.loader import load_model
contexts, rows, repeats = json.loads(sys.argv[1])
torch.set_num_threads(2)
m = load_model("smollm2-135m-instruct", progress=False).model
out, digest = {}, hashlib.sha256()
with torch.inference_mode():
    for ctx in contexts:
        cache = m.new_cache(ctx + max(rows) + 1)
        m.extend(list(range(10, 10 + ctx)), cache)
        for r in rows:
            tokens = torch.arange(20, 20 + r)[None]  # [1, R]
            positions = torch.arange(ctx, ctx + r)  # [R]
            runs = []
            for _ in range(repeats + 1):
                cache.truncate(ctx)
                t0 = time.perf_counter()
                hidden = m(tokens, positions, cache)
                runs.append(time.perf_counter() - t0)
            digest.update(hidden.numpy().tobytes())
            out[f"{ctx}/{r}"] = statistics.median(runs[1:]) * 1e3
print(json.dumps({"ms": out, "digest": digest.hexdigest(), "kernels": m.describe()}))
"""


def run_worker(src: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src / "src")}
    spec = json.dumps([args.contexts, args.rows, args.repeats])
    done = subprocess.run(
        [sys.executable, "-c", WORKER, spec], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"the worker for {src} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        message = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("every value must be at least 1")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="version A: a checkout (its src/ is imported)")
    ap.add_argument("b", type=Path, help="version B: a checkout")
    ap.add_argument("--contexts", type=ints, default=[256, 1024])
    ap.add_argument("--rows", type=ints, default=[1, 2, 5, 8, 16])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    for path in (args.a, args.b):
        if not (path / "src" / "specfork").is_dir():
            raise SystemExit(f"{path} is not a specfork checkout (no src/specfork)")
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for i in range(args.rounds):
        order = (("A", args.a), ("B", args.b)) if i % 2 == 0 else (("B", args.b), ("A", args.a))
        for name, path in order:
            results[name].append(run_worker(path, args))
    a0, b0 = results["A"][0], results["B"][0]
    print(f"A: {args.a} ({a0['kernels']}); B: {args.b} ({b0['kernels']}); {args.rounds} rounds")
    print(f"same hidden states: {'yes' if a0['digest'] == b0['digest'] else 'no'}")
    print("| context | rows | A ms | B ms | B / A |")
    print("|---|---|---|---|---|")
    for key in a0["ms"]:
        ms_a = statistics.median(r["ms"][key] for r in results["A"])
        ms_b = statistics.median(r["ms"][key] for r in results["B"])
        ctx, rows = key.split("/")
        print(f"| {ctx} | {rows} | {ms_a:.2f} | {ms_b:.2f} | {ms_b / ms_a:.2f} |")


if __name__ == "__main__":
    main()
