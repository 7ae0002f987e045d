"""Speculative decoding vs plain decoding, per task category, in one interleaved run.

A thin wrapper around `specfork bench` (the library's `specfork.bench`) with this script's
historical method set: plain decoding, n-gram k=4 (constant and heuristic), n-gram k=8,
optionally the self drafter, and transformers' `generate` and prompt lookup (4). Everything
(interleaving, medians, near-tie greedy matches, the report and plots) is `specfork.bench`.

    python benchmarks/spec_speed.py --prompts benchmarks/prompts/specbench-dev.jsonl \
        --per-category 2 --max-new-tokens 128 --out bench-out/spec_speed

`--out` is a folder (results.json.gz, report.md, PNG plots); a path ending in .json also gets
the results as plain JSON, and the folder is that path without the suffix.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from specfork.bench.report import load_results
from specfork.cli import bench as bench_command
from specfork.errors import SpecforkError

METHODS = [
    "ar",
    "speculative:ngram?k=4",
    "speculative:ngram?k=4&k_policy=heuristic",
    "speculative:ngram?k=8",
]
HF_METHODS = ["hf:ar", "hf:prompt-lookup?k=4"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=Path, default=Path("benchmarks/prompts/specbench-dev.jsonl"))
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--self",
        dest="self_spec",
        default=None,
        help="also run the self drafter with these --skip-layers, e.g. 10-19",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    ap.add_argument("--out", type=Path, default=Path("bench-out/spec_speed"))
    args = ap.parse_args()  # fmt: skip
    methods = list(METHODS)
    if args.self_spec:
        methods.append(f"speculative:self?skip_layers={args.self_spec}&k=3")
    if not args.no_hf:
        methods += HF_METHODS
    out = args.out.with_suffix("") if args.out.suffix == ".json" else args.out
    bench = argparse.ArgumentParser(prog="specfork")
    bench_command.add_parser(bench.add_subparsers(dest="command"))
    bench_args = bench.parse_args(
        ["bench", "--model", args.model, "--dtype", args.dtype, "--device", "cpu",
         "--prompts", str(args.prompts), "--per-category", str(args.per_category),
         "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats),
         "--strategies", ",".join(methods), "--out", str(out)]
    )  # fmt: skip
    err = Console(stderr=True)
    try:
        code = bench_command.run(bench_args, err)
    except SpecforkError as exc:
        err.print(f"error: {exc}", markup=False)
        return 2
    if args.out.suffix == ".json":
        args.out.write_text(json.dumps(load_results(out), indent=1) + "\n", encoding="utf-8")
    return code


if __name__ == "__main__":
    sys.exit(main())
