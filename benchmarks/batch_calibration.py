"""Is the batch's goodput allocation calibrated? Expected against accepted draft tokens.

Runs the same prompts through `Scheduler` with plain decoding and with a speculative
strategy, up to `--max-running` requests at a time (finished requests make room for waiting
ones), and reports from `Scheduler.steps`: the steps taken, the steps that verified drafts,
their draft rows, the accepted tokens the allocation expected (`predicted`) and those accepted.

    python benchmarks/batch_calibration.py --max-running 16 8 --prompts-count 16 -n 64
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from pathlib import Path

from specfork.bench.prompts import load_prompts
from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.batch import BatchConfig, Scheduler
from specfork.engine.generator import Generator
from specfork.loading.loader import load_model

STRATEGIES = {"ar": SpecConfig(), "ngram": SpecConfig("speculative", "ngram", k=4)}


def run(gen: Generator, prompts: list[str], config: GenerationConfig, spec: SpecConfig,
        max_running: int) -> str:  # fmt: skip
    """One batch run; a table row of its figures."""
    scheduler = Scheduler(gen, BatchConfig.rows_for(max_running))
    waiting, tokens, t0 = deque(prompts), 0, time.perf_counter()
    while waiting or scheduler.running:
        while waiting and scheduler.has_room():
            scheduler.add(waiting.popleft(), config=config, spec=spec)
        tokens += sum(len(u.result.token_ids) for u in scheduler.step() if u.result is not None)
    seconds = time.perf_counter() - t0
    drafting = [s for s in scheduler.steps if s.draft_rows]
    rows = sum(s.draft_rows for s in drafting)
    predicted, accepted = sum(s.predicted for s in drafting), sum(s.accepted for s in drafting)
    return (f"| {tokens / seconds:.1f} | {len(scheduler.steps)} | {len(drafting)} | {rows} | "
            f"{predicted:.1f} | {accepted} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, default=Path("benchmarks/prompts/specbench-dev.jsonl"))
    ap.add_argument("--every", type=int, default=4, help="take every N-th prompt of the file")
    ap.add_argument("--prompts-count", type=int, default=16)
    ap.add_argument("--max-running", type=int, nargs="+", default=[16, 8])
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    prompts = [p.text for p in load_prompts(args.prompts)][:: args.every][: args.prompts_count]
    gen = Generator(load_model("smollm2-135m-instruct", progress=False))
    config = GenerationConfig(max_new_tokens=args.n, ignore_eos=True)
    print(f"{len(prompts)} prompts x {args.n} tokens")
    print("| max-running | strategy | tok/s | steps | drafting steps | draft rows | "
          "expected accepted | accepted |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for max_running in args.max_running:
        for _ in range(args.repeats):  # interleaved: plain, then speculative, each repeat
            for name, spec in STRATEGIES.items():
                row = run(gen, prompts, config, spec, max_running)
                print(f"| {max_running} | {name} {row}", flush=True)


if __name__ == "__main__":
    main()
