"""What keyed seeded sampling costs a sampled drafter: acceptance with a seed (keyed coupling,
`specfork.verify.keyed`) against acceptance without one (rejection sampling, min(1, p/q)),
on the same prompts, drafter and sampling parameters, without the goodput gate.

Reports, per draft length K, the mean fraction of drafted tokens accepted and the mean tokens
emitted per target forward. Deterministic drafters (n-gram, recycle) lose nothing to the
keyed coupling; a sampled one (the head's chain, a draft model) accepts when q's and p's
inverse CDFs agree at the keyed uniform, which is less often than min(1, p/q) when q != p.

    python benchmarks/seeded_acceptance.py --drafter head --k 1 4 -n 64 --seeds 1 2
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from specfork.bench.prompts import load_prompts, select_prompts
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.engine.generator import Generator
from specfork.loading.loader import load_model

COUPLINGS = ("keyed", "rejection")  # with a seed, without one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, default=Path("benchmarks/prompts/specbench-dev.jsonl"))
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--drafter", default="head")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4])
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    args = ap.parse_args()
    prompts = [p.text for p in select_prompts(load_prompts(args.prompts), args.per_category)]
    loaded = load_model("smollm2-135m-instruct", progress=False)
    config = GenerationConfig(max_new_tokens=args.n, ignore_eos=True)
    print(f"{len(prompts)} prompts x {len(args.seeds)} seeds x {args.n} tokens, {args.drafter}")
    print("| K | coupling | accepted / drafted | tokens per forward |")
    print("|---|---|---|---|")
    for k in args.k:
        gen = Generator(loaded, spec=SpecConfig("speculative", args.drafter, k=k, goodput=False))
        # coupling -> (accepted / drafted, tokens per forward) per run
        rows: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in COUPLINGS}
        for prompt in prompts:
            for seed in args.seeds:
                for coupling in rows:  # unseeded: fresh random draws every run
                    params = SamplingParams(
                        temperature=args.temperature,
                        top_p=args.top_p,
                        seed=seed if coupling == "keyed" else None,
                    )
                    s = gen.generate(prompt, config=config, sampling=params).stats
                    rows[coupling][0].append(s.accepted / max(s.drafted, 1))
                    rows[coupling][1].append(s.new_tokens / max(s.target_forwards, 1))
        for coupling, (acc, tpf) in rows.items():
            print(f"| {k} | {coupling} | {statistics.mean(acc):.3f} | {statistics.mean(tpf):.2f} |")


if __name__ == "__main__":
    main()
