"""Speculative decoding vs plain decoding, per task category, in one interleaved run.

Methods run prompt by prompt in turn (after a warm-up), greedy, same prompt ids; medians of
per-prompt figures. specfork's decode tokens/s excludes prefill (its own clock); for
transformers `generate` it is (n - 1) / (t(n tokens) - t(1 token)) on the same prompt.

    python benchmarks/spec_speed.py --prompts ../shared/bench/specbench-dev.jsonl \
        --per-category 2 --max-new-tokens 128 --out bench-out/spec_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine import Generator
from specfork.loading.loader import load_model
from specfork.loading.registry import resolve_model

METHODS = {
    "ar": SpecConfig(),
    "ngram k=4": SpecConfig("speculative", "ngram", k=4),
    "ngram heuristic": SpecConfig("speculative", "ngram", k=4, k_policy="heuristic"),
    "ngram k=8": SpecConfig("speculative", "ngram", k=8),
}


def read_prompts(path: Path, per_category: int) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    seen: dict[str, int] = defaultdict(int)
    picked = []
    for r in rows:
        if seen[r["category"]] < per_category:
            seen[r["category"]] += 1
            picked.append((r["category"], r["turns"][0]))
    return picked


def specfork_runner(gen: Generator, n: int) -> Callable[[list[int]], dict]:
    def run(ids: list[int]) -> dict:
        res = gen.generate(list(ids), config=GenerationConfig(max_new_tokens=n))
        s = res.stats
        return {"tok_s": s.decode_tokens_per_second, "ids": res.token_ids,
                "mal": s.mean_accepted_length, "acc": s.acceptance_rate,
                "drafted": s.drafted, "accepted": s.accepted}  # fmt: skip

    return run


def hf_runner(model: torch.nn.Module, n: int, eos: int, **kwargs: object) -> Callable:
    def generate(ids: list[int], k: int) -> tuple[float, list[int]]:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos,
                                 **kwargs)  # fmt: skip
        new = out[0, len(ids) :].tolist()
        return time.perf_counter() - t0, new

    def run(ids: list[int]) -> dict:
        t1, _ = generate(ids, 1)
        tn, new = generate(ids, n)
        produced = new[: new.index(eos)] if eos in new else new
        rate = (len(new) - 1) / (tn - t1) if len(new) > 1 and tn > t1 else 0.0
        return {"tok_s": rate, "ids": produced, "mal": None, "acc": None}

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=Path, default=Path("../shared/bench/specbench-dev.jsonl"))
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--self",
        dest="self_spec",
        default=None,
        help="also run the self drafter with these --skip-layers, e.g. 10-19",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    ap.add_argument("--out", type=Path, default=Path("bench-out/spec_speed.json"))
    args = ap.parse_args()  # fmt: skip
    n = args.max_new_tokens
    loaded = load_model(args.model, dtype=args.dtype, device="cpu", progress=False)
    methods = dict(METHODS)
    if args.self_spec:
        methods[f"self skip {args.self_spec}"] = SpecConfig(
            "speculative", "self", k=3, skip_layers=args.self_spec
        )
    runners = {name: specfork_runner(Generator(loaded, spec=s), n) for name, s in methods.items()}
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        path = resolve_model(args.model)
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=getattr(torch, args.dtype)
        ).eval()
        eos = min(loaded.tokenizer.eos_ids)
        runners["hf:ar"] = hf_runner(hf, n, eos)
        runners["hf:prompt-lookup"] = hf_runner(hf, n, eos, prompt_lookup_num_tokens=4)
    gen = Generator(loaded)
    prompts = [(c, gen.encode_prompt(p)) for c, p in read_prompts(args.prompts, args.per_category)]
    for run in runners.values():  # warm-up
        run(prompts[0][1])
    rows = []
    for i, (cat, ids) in enumerate(prompts):
        results = {name: run(ids) for name, run in runners.items()}
        ar = results["ar"]
        for name, r in results.items():
            r["speedup"] = r["tok_s"] / ar["tok_s"] if ar["tok_s"] else 0.0
            r["match"] = r["ids"] == ar["ids"]
            rows.append({"prompt": i, "category": cat, "method": name,
                         **{k: v for k, v in r.items() if k != "ids"}})  # fmt: skip
        print(i, cat, {k: round(v["speedup"], 2) for k, v in results.items()}, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(markdown_table(rows, list(runners)))


def markdown_table(rows: list[dict], methods: list[str]) -> str:
    """Per category and overall: median decode tok/s, speedup, tokens/forward, acceptance."""
    cats = [*sorted({r["category"] for r in rows}), "overall"]
    lines = ["| method | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for m in methods:
        cells = []
        for c in cats:
            sel = [r for r in rows if r["method"] == m and c in (r["category"], "overall")]
            speed = statistics.median(r["speedup"] for r in sel)
            tps = statistics.median(r["tok_s"] for r in sel)
            cell = f"{speed:.2f}× ({tps:.0f} tok/s"
            drafted = sum(r.get("drafted") or 0 for r in sel)
            if drafted:
                acc = sum(r["accepted"] for r in sel) / drafted
                cell += f", {statistics.median(r['mal'] for r in sel):.2f} tok/fwd, acc {acc:.0%}"
            match = sum(r["match"] for r in sel) / len(sel)
            cells.append(cell + f", match {match:.0%})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
