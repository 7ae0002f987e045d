"""Decoding speed when other jobs share the cores, against the same machine idle.

One process loads the default model once and decodes N tokens (plain, greedy, EOS ignored) under
each thread setting in turn: `auto` (the default: the usable cores, fewer while other jobs keep
them busy) and fixed counts. It does so on an idle machine and while each competing job runs:

- `specfork`: another process decoding with specfork at its default settings, nonstop;
- `torch`: a PyTorch job of two intra-op threads multiplying 512 x 512 matrices, nonstop;
- `spin`: two processes that only count (pure CPU, no memory traffic).

Every repeat measures every (job, setting) pair once, jobs in turn, so slow drifts of the
machine hit all of them; the table gives medians and the ratio to the idle machine at `auto`.

    python benchmarks/shared_cores.py [--tokens 200] [--repeats 3] [--settings auto,1,2]
        [--jobs specfork,torch,spin] [--out shared-cores.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specfork.bench.machine import machine_info
from specfork.config import GenerationConfig
from specfork.engine.generator import Generator
from specfork.loading.loader import load_model
from specfork.threads import parse_threads

log = logging.getLogger("shared_cores")

PROMPTS = (
    "Write a long story about a dragon who learns to paint.",
    "Explain step by step how a CPU cache works.",
    "List twenty fruits and say one thing about each.",
)
JOBS = ("specfork", "torch", "spin")
SETTLE_SECONDS = 2.0  # a competing job runs this long before measuring starts


def compete(kind: str) -> None:
    """Run one competing job until killed (this script started with --compete KIND)."""
    if kind == "specfork":
        gen = Generator(load_model("smollm2-135m-instruct", progress=False))
        cfg = GenerationConfig(max_new_tokens=256, ignore_eos=True)
        while True:
            gen.generate(PROMPTS[0], config=cfg)
    if kind == "torch":
        torch.set_num_threads(2)
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        while True:
            a @ b
    if kind == "spin":
        workers = [multiprocessing.Process(target=_count) for _ in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    raise SystemExit(f"unknown job {kind!r}; one of {', '.join(JOBS)}")


def _count() -> None:
    n = 0
    while True:
        n += 1


def start_job(kind: str) -> subprocess.Popen | None:
    if kind == "idle":
        return None
    job = subprocess.Popen([sys.executable, __file__, "--compete", kind], start_new_session=True)
    time.sleep(SETTLE_SECONDS)
    return job


def stop_job(job: subprocess.Popen | None) -> None:
    """Ends the job and every process it started (its own process group)."""
    if job is not None:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait()
        for _ in range(100):  # its children (the spinning processes) are gone too
            try:
                os.killpg(job.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)


def decode_speed(gen: Generator, setting: str, prompt: str, tokens: int) -> dict:
    """One generation under `setting`: decode tok/s and what the threads saw."""
    gen.model.set_threads(parse_threads(setting))
    res = gen.generate(prompt, config=GenerationConfig(max_new_tokens=tokens, ignore_eos=True))
    threads = res.stats.threads
    return {
        "tok_s": res.stats.decode_tokens_per_second,
        "reduced": threads.reduced if threads else 0.0,
        "busy": threads.busy if threads else 0.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--settings", default="auto,1,2", help="thread settings, comma-separated")
    p.add_argument("--jobs", default=",".join(JOBS), help="competing jobs, comma-separated")
    p.add_argument("--out", type=Path, default=None, help="results as JSON")
    p.add_argument("--compete", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.compete:
        compete(args.compete)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = args.settings.split(",")
    jobs = ["idle", *args.jobs.split(",")]
    for s in settings:
        parse_threads(s)
    gen = Generator(load_model("smollm2-135m-instruct", progress=False))
    gen.generate(PROMPTS[1], config=GenerationConfig(max_new_tokens=16))  # warm-up
    runs: dict[tuple[str, str], list[dict]] = {(j, s): [] for j in jobs for s in settings}
    for r in range(args.repeats):
        for job_kind in jobs:
            job = start_job(job_kind)
            try:
                for i, setting in enumerate(settings):
                    prompt = PROMPTS[(r + i) % len(PROMPTS)]
                    run = decode_speed(gen, setting, prompt, args.tokens)
                    runs[job_kind, setting].append(run)
                    log.info("repeat %d, %s, threads %s: %.1f tok/s (fewer threads %.0f%%, "
                             "busy %.0f%%)", r + 1, job_kind, setting, run["tok_s"],
                             100 * run["reduced"], 100 * run["busy"])  # fmt: skip
            finally:
                stop_job(job)
    report(runs, jobs, settings, args)


def report(runs: dict, jobs: list[str], settings: list[str], args: argparse.Namespace) -> None:
    idle = statistics.median(r["tok_s"] for r in runs["idle", settings[0]])
    lines = [
        f"| job sharing the cores | {' | '.join(f'threads {s}' for s in settings)} |",
        "|---|" + "---|" * len(settings),
    ]
    for job in jobs:
        cells = []
        for s in settings:
            speed = statistics.median(r["tok_s"] for r in runs[job, s])
            cells.append(f"{speed:.0f} tok/s ({speed / idle:.2f}×)")
        lines.append(f"| {job} | {' | '.join(cells)} |")
    print("\n".join(lines))
    print(f"\nratios: to the idle machine at threads {settings[0]} ({idle:.0f} tok/s); medians of "
          f"{args.repeats} repeats, {args.tokens} tokens each")  # fmt: skip
    if args.out is not None:
        doc = {
            "machine": machine_info(), "tokens": args.tokens, "repeats": args.repeats,
            "runs": [{"job": j, "threads": s, **r} for (j, s), rs in runs.items() for r in rs],
        }  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
