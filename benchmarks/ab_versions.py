"""Two versions of specfork side by side: is a change (a refactor) free of slowdowns?

Each version runs in its own worker process (PYTHONPATH = its `src` folder), loads the default
model once, builds every strategy and warms it up; both use the goodput gate's cost curve that
A measured (a curve measured in each process would differ by timing noise and make the two
gates draft differently; with `--own-curves` each uses its own, for a change of the kernels,
whose costs are what changed; with `--one-generator` every strategy runs on one Generator with
the model's own curve, as in `specfork bench` and the server). Then the prompts are sent to the
two workers alternately (the version that goes first alternates too), so both see the same
machine state.
Only one worker computes at a time. With `--batch N` the prompts go in groups of N through
`generate_batch` (up to N requests decoding in each forward), and a job's speed is its generated
tokens over its wall time (prefill included). Prints, per strategy, the median tokens/s of each
version, the median of the per-prompt ratios B / A, and whether both versions emitted the same
tokens (EOS ignored; greedy by default, or seeded sampling with `--temperature`/`--top-p`;
`--unseeded`: each request's own random stream, tokens not compared).

    git worktree add /tmp/specfork-old <old commit>
    python benchmarks/ab_versions.py /tmp/specfork-old . \\
        --prompts benchmarks/prompts/specbench-dev.jsonl --per-category 1 -n 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

STRATEGIES = {
    "plain": {},
    "ngram k=4": {"strategy": "speculative", "drafter": "ngram", "k": 4},
    "dspark ngram": {"strategy": "dspark", "drafter": "ngram"},
    "spork recycle+ngram": {"strategy": "spork", "drafter": "recycle+ngram"},
}
HEADS = {  # with --heads: the packaged draft head (both versions must ship one)
    "head": {"strategy": "speculative", "drafter": "head"},
    "head k=1, gate off": {"strategy": "speculative", "drafter": "head", "k": 1, "goodput": False},
    "ngram+head": {"strategy": "speculative", "drafter": "ngram+head"},
}
SUFFIX = {  # with --suffix: the suffix drafter (shared across each version's requests)
    "speculative suffix": {"strategy": "speculative", "drafter": "suffix"},
    "dspark suffix": {"strategy": "dspark", "drafter": "suffix"},
    "spork recycle+suffix": {"strategy": "spork", "drafter": "recycle+suffix"},
}

WORKER = r"""
import json, sys, time
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork import Generator  # the lazy export: both old and new versions have it
from specfork.loading.loader import load_model
from specfork.loading.registry import DEFAULT_MODEL
from specfork.engine.batch import BatchConfig, generate_batch

strategies = json.loads(sys.argv[1])
n = int(sys.argv[2])
loaded = load_model(DEFAULT_MODEL, progress=False)
curve = loaded.model.cost_curve()  # the goodput gate's cost curve: measured, or B gets A's
if sys.argv[3] != "measure":
    rows, cost = json.loads(sys.argv[3])
    curve = type(curve)(tuple(rows), tuple(cost))
specs = {name: SpecConfig(**kw) for name, kw in strategies.items()}
if sys.argv[5] == "one":  # one Generator, the model's own curve: what the bench and server run
    one = Generator(loaded)
    gens = {name: one for name in specs}
else:
    gens = {name: Generator(loaded, spec=spec, cost_curve=curve) for name, spec in specs.items()}
config = GenerationConfig(max_new_tokens=n, ignore_eos=True)
sampling = SamplingParams(**json.loads(sys.argv[4]))
for name, gen in gens.items():
    gen.generate("Hello, how are you?", config=config, spec=specs[name])
print(json.dumps({"ready": loaded.model.describe(), "curve": [curve.rows, curve.cost]}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    gen, prompts, spec = gens[job["strategy"]], job["prompts"], specs[job["strategy"]]
    gen.use_strategy(spec)
    if len(prompts) == 1:
        result = gen.generate(prompts[0], config=config, sampling=sampling, spec=spec)
        out = {"tok_s": result.stats.decode_tokens_per_second, "ids": [result.token_ids]}
    else:
        t0 = time.perf_counter()
        batch = BatchConfig.rows_for(len(prompts))
        results = generate_batch(gen, prompts, config=config, sampling=sampling, batch=batch)
        ids = [r.token_ids for r in results]
        out = {"tok_s": sum(map(len, ids)) / (time.perf_counter() - t0), "ids": ids}
    print(json.dumps(out), flush=True)
"""


class Worker:
    """One version's worker process."""

    def __init__(
        self,
        root: Path,
        n: int,
        strategies: dict,
        sampling: dict,
        curve: list | None = None,
        one: bool = False,
    ) -> None:
        env = {**os.environ, "PYTHONPATH": str(root / "src")}
        given = "measure" if curve is None else json.dumps(curve)
        args = [sys.executable, "-c", WORKER, json.dumps(strategies), str(n), given]
        args += [json.dumps(sampling), "one" if one else "own"]
        self.proc = subprocess.Popen(
            args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        ready = self._read()
        self.describe, self.curve = ready["ready"], ready["curve"]

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker stopped (exit {self.proc.wait()})")
        return json.loads(line)

    def run(self, strategy: str, prompts: list[str]) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"strategy": strategy, "prompts": prompts}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="version A: a specfork checkout (the baseline)")
    ap.add_argument("b", type=Path, help="version B: a specfork checkout (the change)")
    ap.add_argument("--prompts", type=Path, default=Path("benchmarks/prompts/specbench-dev.jsonl"))
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--heads", action="store_true", help="also the packaged draft head's chains")
    ap.add_argument("--suffix", action="store_true", help="also the suffix drafter's strategies")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument(
        "--unseeded",
        action="store_true",
        help="sample from each request's own random stream (no seed): the engine's unseeded "
        "path; the versions' tokens then differ",
    )
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together (1: alone)")
    ap.add_argument(
        "--own-curves", action="store_true", help="each version its own cost curve (kernels)"
    )
    ap.add_argument(
        "--one-generator",
        action="store_true",
        help="each version runs every strategy on one Generator with the model's own cost "
        "curve, as `specfork bench` and the server do (a change to what requests share)",
    )
    args = ap.parse_args()
    seed = None if args.unseeded else 0
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": seed}
    strategies = {**STRATEGIES, **(HEADS if args.heads else {}), **(SUFFIX if args.suffix else {})}
    sys.path.insert(0, str(args.b / "src"))
    from specfork.bench.prompts import load_prompts, select_prompts

    picked = select_prompts(load_prompts(args.prompts), per_category=args.per_category)
    texts = [p.text for p in picked]
    prompts = [texts[i : i + args.batch] for i in range(0, len(texts), args.batch)]
    one = args.one_generator
    a = Worker(args.a, args.max_new_tokens, strategies, sampling, one=one)  # measures a curve...
    given = None if args.own_curves or one else a.curve  # ...B uses A's, or measures its own
    b = Worker(args.b, args.max_new_tokens, strategies, sampling, given, one)
    workers = {"A": a, "B": b}
    groups = f"{len(texts)} prompts in groups of {args.batch}"
    print(f"A: {a.describe}; B: {b.describe}; {groups}; sampling {sampling}")
    for name, worker in workers.items():
        cost = [round(c, 2) for c in worker.curve[1]]
        print(f"cost curve {name}: rows {worker.curve[0]}, cost {cost}")
    rows: dict[str, dict[str, list]] = {s: {"A": [], "B": [], "same": []} for s in strategies}
    for i, prompt in enumerate(prompts):
        for strategy in strategies:
            order = ("A", "B") if i % 2 == 0 else ("B", "A")
            out = {v: workers[v].run(strategy, prompt) for v in order}
            rows[strategy]["A"].append(out["A"]["tok_s"])
            rows[strategy]["B"].append(out["B"]["tok_s"])
            rows[strategy]["same"].append(out["A"]["ids"] == out["B"]["ids"])
    for worker in workers.values():
        worker.close()
    print("| strategy | A tok/s | B tok/s | B / A (median of per-prompt ratios) | same tokens |")
    print("|---|---|---|---|---|")
    for strategy, r in rows.items():
        ratio = statistics.median(b / a for a, b in zip(r["A"], r["B"], strict=True))
        same = f"{sum(r['same'])}/{len(r['same'])}"
        print(
            f"| {strategy} | {statistics.median(r['A']):.1f} | {statistics.median(r['B']):.1f} "
            f"| {ratio:.3f} | {same} |"
        )


if __name__ == "__main__":
    main()
