"""Replay a greedy `specfork bench` run's plain outputs through draft sources, offline.

Greedy output does not depend on the drafter, so how many tokens a chain drafter gets accepted
is a function of the text alone: at each round the drafter proposes up to K tokens after the
history, the longest prefix equal to plain decoding's next tokens is accepted, and the target's
token follows. This replays `ar`'s outputs of a bench run (every prompt and turn, in the run's
order, so a suffix index learns from earlier requests as it did in the run) through several
drafters and reports tokens per target forward with no goodput gate and no model: a drafter's
reach in seconds, before any timing noise. It needs the bench's prompts (the same `--prompts`
or `--workload` and `--per-category`) to rebuild each turn's context.

    python benchmarks/drafter_replay.py /tmp/run/results.json.gz --workload agent \
        --per-category 3 --drafters ngram suffix suffix:own=0

With `--curves A.json B.json`, every drafter is also replayed through a goodput gate (its rates
handed from request to request, as in the bench) priced by each cost curve, and the speed is
modelled: plain decoding's one-row steps over the rounds' c(rows), both at their context
(`CostCurve.at`, `step_at`). The same texts under two curves judge a change of the kernels'
costs apart from the texts it makes (a quantized model's greedy text changes with any change of
arithmetic). A curve file is the cost cache's JSON (`~/.cache/specfork/cost/`), or one written
by `--measure-curve OUT` under the version to judge:

    PYTHONPATH=/tmp/old/src python benchmarks/drafter_replay.py --measure-curve /tmp/old.json
    python benchmarks/drafter_replay.py --measure-curve /tmp/new.json
    python benchmarks/drafter_replay.py /tmp/run/results.json.gz --workload all \
        --per-category 4 --drafters suffix --curves /tmp/old.json /tmp/new.json
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import logging
import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from specfork.bench.prompt_file import load_prompts
from specfork.bench.prompts import select_prompts
from specfork.bench.runner import first_turn, following_turn
from specfork.bench.workloads import workload_prompts
from specfork.config import SamplingParams
from specfork.drafters.base import DraftShape
from specfork.drafters.ngram import NgramDrafter
from specfork.drafters.suffix import SuffixDrafter, SuffixSettings
from specfork.drafters.suffix_index import SuffixIndex
from specfork.engine.generator import Generator
from specfork.loading.loader import load_model
from specfork.models.cost import CostCurve
from specfork.models.cost_cache import read_curve, write_curve
from specfork.strategies.goodput import GoodputGate
from specfork.strategies.rate_memory import RateMemory
from specfork.verify import Verdict

log = logging.getLogger("drafter_replay")


def drafter(spec: str) -> object:
    """ "ngram", "ngram:max=N", "suffix", "suffix:factor=F,prob=P,match=M" (a fresh index)."""
    name, _, options = spec.partition(":")
    opts = dict(o.split("=") for o in options.split(",") if o)
    if name == "ngram":
        return NgramDrafter(int(opts.get("max", 3)), int(opts.get("min", 1)))
    if name == "suffix":
        settings = SuffixSettings(
            max_match=int(opts.get("match", 12)),
            spec_factor=float(opts.get("factor", 1.0)),
            min_prob=float(opts.get("prob", 0.1)),
            own=opts.get("own", "1") == "1",
        )
        return SuffixDrafter(SuffixIndex(), settings)
    raise SystemExit(f"unknown drafter {spec!r}: ngram[:max=N,min=N] or suffix[:factor=F,...]")


def replay(source: object, prompt: list[int], output: list[int], k: int) -> tuple[int, int]:
    """(target forwards, tokens emitted) of decoding `output` after `prompt` with `source`'s
    chains of up to `k` tokens (the first token comes from the prefill)."""
    request = source.begin(prompt)
    rng, greedy = torch.Generator(), SamplingParams()
    t, forwards = 1, 0
    while t < len(output):
        history = prompt + output[:t]
        draft = request.propose(history, DraftShape(k), greedy, rng).tokens.tolist()
        accepted = 0
        while accepted < len(draft) and t + accepted < len(output):
            if draft[accepted] != output[t + accepted]:
                break
            accepted += 1
        t += accepted + 1
        forwards += 1
    request.propose(prompt + output, DraftShape(1), greedy, rng)  # index the whole answer
    return forwards, len(output) - 1


def turns(args: argparse.Namespace, generator: Generator, results: dict) -> list[tuple]:
    """(category, turn, prompt ids, ar's output ids) in the run's order."""
    prompts = workload_prompts(args.workload) if args.workload else load_prompts(args.prompts)
    prompts = select_prompts(prompts, args.per_category)
    outputs = {
        (int(m["prompt_index"]), int(m["turn"])): m["token_ids"]
        for m in results["measurements"]
        if m["strategy"] == "ar" and int(m["repeat"]) == 0
    }
    chat = results["settings"].get("chat", True)
    out = []
    for i, prompt in enumerate(prompts):
        p = first_turn(generator, i, prompt, chat)
        while (i, p.turn) in outputs:
            ids = outputs[(i, p.turn)]
            out.append((prompt.category, p.turn, list(p.ids), ids))
            if p.turn >= len(prompt.turns):
                break
            answer = SimpleNamespace(text=None, token_ids=ids)
            p = following_turn(generator, p, answer)
    return out


def replay_gated(
    spec: str, cases: list[tuple], curve: CostCurve, k: int, policy: str = "gate"
) -> dict:
    """Per (category, later turn): [plain steps' cost, the rounds' cost, tokens, forwards] of
    `spec`'s chains trimmed by a goodput gate priced by `curve` (one-row forwards at the
    curve's own context), every request's gate starting from the earlier ones' rates.
    `policy` "oracle" verifies exactly the tokens that will be accepted (a bound no gate
    reaches), "streak" gives the gate two sources per drafter: after a round whose proposal
    matched as far as it was seen, and after any other."""
    source, memory = drafter(spec), RateMemory()
    out: dict[tuple[str, bool], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for cat, turn, prompt, output in cases:
        request, gate = source.begin(prompt), GoodputGate(curve, memory)
        rng, greedy, t, hot = torch.Generator(), SamplingParams(), 1, False
        while t < len(output):
            context = len(prompt) + t
            gate.at_context(context)
            proposed = request.propose(prompt + output[:t], DraftShape(k), greedy, rng)
            if policy == "streak" and len(proposed):
                proposed = replace(proposed, source=f"{proposed.source}|{hot}")
            kept = gate.trim(proposed, False) if len(proposed) else proposed
            draft = kept.tokens.tolist() if len(kept) else []
            if policy == "oracle":
                draft = proposed.tokens.tolist() if len(proposed) else []
            accepted = 0
            while accepted < len(draft) and t + accepted < len(output):
                if draft[accepted] != output[t + accepted]:
                    break
                accepted += 1
            if policy == "oracle":
                draft = draft[:accepted]
            emitted = output[t : t + accepted + 1]
            seen = min(len(proposed), len(output) - t)
            hot = seen > 0 and proposed.tokens[:seen].tolist() == output[t : t + seen]
            if len(proposed):
                gate.learn(proposed, kept, Verdict(list(range(accepted)), emitted), False)
            row = out[(cat, turn > 1)]
            row[0] += sum(curve.step_at(context + j) for j in range(len(emitted)))
            row[1] += curve.at(context)(len(draft) + 1) * curve.step_at(context)
            row[2] += len(emitted)
            row[3] += 1
            t += accepted + 1
        request.propose(prompt + output, DraftShape(1), greedy, rng)
    return out


def gated_table(args: argparse.Namespace, cases: list[tuple]) -> None:
    """The modelled speed of every drafter under every curve (see the module doc)."""
    log.info(
        "\nthrough a goodput gate, speed modelled from each curve (x plain / tokens per forward)"
    )
    for spec, path, policy in itertools.product(args.drafters, args.curves, args.policies):
        curve = read_curve(path, max_age_days=None)
        if curve is None:
            raise SystemExit(f"{path} holds no cost curve of this version: --measure-curve")
        out = replay_gated(spec, cases, curve, args.k, policy)
        total = [sum(v[i] for v in out.values()) for i in range(4)]
        cells = [f"all {total[0] / total[1]:.2f}x/{total[2] / total[3]:.2f}"]
        for (cat, later), v in sorted(out.items()):
            cells.append(f"{cat}{'+' if later else ''} {v[0] / v[1]:.2f}x/{v[2] / v[3]:.2f}")
        log.info("%s, %s, %s: %s", spec, path.name, policy, " ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, nargs="?", help="a greedy bench run's results.json.gz")
    ap.add_argument("--prompts", type=Path, default=Path("../shared/bench/specbench-dev.jsonl"))
    ap.add_argument("--workload", help="the run's --workload instead of --prompts")
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--drafters", nargs="+", default=["ngram", "suffix"])
    ap.add_argument("-k", type=int, default=16, help="the chain's most tokens")
    ap.add_argument("--curves", type=Path, nargs="+", default=[], help="cost curve files")
    ap.add_argument("--policies", nargs="+", default=["gate"], choices=["gate", "oracle", "streak"])
    ap.add_argument("--measure-curve", type=Path, help="measure this version's curve, write it")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.measure_curve is not None:
        curve = CostCurve.measure(load_model("smollm2-135m-instruct", progress=False).model)
        write_curve(curve, args.measure_curve)
        log.info("wrote %s: %s", args.measure_curve, curve)
        return
    if args.results is None:
        ap.error("a bench run's results.json.gz is needed (or --measure-curve)")
    with gzip.open(args.results, "rt") as f:
        results = json.load(f)
    generator = Generator(load_model("smollm2-135m-instruct", progress=False))
    cases = turns(args, generator, results)
    log.info("%d requests replayed, K = %d, no goodput gate", len(cases), args.k)
    log.info("| drafter | tokens/forward (all) | first turns | later turns | by category |")
    log.info("|---|---|---|---|---|")
    for spec in args.drafters:
        source = drafter(spec)
        rows = [(cat, turn, *replay(source, ids, out, args.k)) for cat, turn, ids, out in cases]
        by_cat: dict[str, list[float]] = defaultdict(list)
        for cat, _, f, n in rows:
            by_cat[cat].append(n / max(f, 1))

        def ratio(sel: list[tuple]) -> str:
            f, n = sum(r[2] for r in sel), sum(r[3] for r in sel)
            return f"{n / f:.2f}" if f else "n/a"

        cats = " ".join(f"{c} {statistics.median(v):.2f}" for c, v in sorted(by_cat.items()))
        first = [r for r in rows if r[1] == 1]
        later = [r for r in rows if r[1] > 1]
        log.info("| %s | %s | %s | %s | %s |", spec, ratio(rows), ratio(first), ratio(later), cats)
    if args.curves:
        gated_table(args, cases)


if __name__ == "__main__":
    main()
