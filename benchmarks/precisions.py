"""Precision and backend side by side: the GGUF's own blocks and bf16 on the kernels, bf16 on the
eager PyTorch path; plain decoding and n-gram speculation on each, interleaved prompt by prompt.

Reports, per configuration, median decode tok/s, the median per-prompt ratio to the default
(gguf on the kernels, plain) and the exact-match rate of speculation against plain decoding of
the same configuration: what the default precision is chosen on, and what exactness costs
(the eager bf16 path is the fastest path that is not batch-invariant).

    python benchmarks/precisions.py --prompts benchmarks/prompts/specbench-dev.jsonl \\
        --per-category 1 -n 128 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from specfork.bench.prompts import load_prompts, select_prompts
from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.generator import Generator
from specfork.loading.loader import load_model

MODELS = {
    "gguf, kernels": {"dtype": "gguf", "kernels": True},
    "bfloat16, kernels": {"dtype": "bfloat16", "kernels": True},
    "bfloat16, eager": {"dtype": "bfloat16", "kernels": False},
}
SPECS = {"plain": SpecConfig(), "ngram k=4": SpecConfig("speculative", "ngram", k=4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, default=Path("benchmarks/prompts/specbench-dev.jsonl"))
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    prompts = [p.text for p in select_prompts(load_prompts(args.prompts), args.per_category)]
    gens = {}
    for name, kw in MODELS.items():
        loaded = load_model("smollm2-135m-instruct", progress=False, **kw)
        gens[name] = Generator(loaded)
        gens[name].warm_up()
    config = GenerationConfig(max_new_tokens=args.n)
    rates: dict[tuple[str, str], list[list[float]]] = {}
    same: dict[tuple[str, str], int] = {}
    for prompt in prompts:
        for _ in range(args.repeats):
            for name, gen in gens.items():
                plain_ids = None
                for sname, spec in SPECS.items():
                    r = gen.generate(prompt, config=config, spec=spec)
                    rates.setdefault((name, sname), []).append(r.stats.decode_tokens_per_second)
                    if plain_ids is None:
                        plain_ids = r.token_ids
                    else:
                        hit = r.token_ids == plain_ids
                        same[(name, sname)] = same.get((name, sname), 0) + hit
    ref = rates[("gguf, kernels", "plain")]
    print("| precision, backend | strategy | decode tok/s | vs gguf plain | exact match |")
    print("|---|---|---|---|---|")
    for (name, sname), values in rates.items():
        ratio = statistics.median(v / b for v, b in zip(values, ref, strict=True))
        match = "—" if sname == "plain" else f"{same[(name, sname)] / len(values):.0%}"
        print(f"| {name} | {sname} | {statistics.median(values):.1f} | {ratio:.2f}× | {match} |")


if __name__ == "__main__":
    main()
