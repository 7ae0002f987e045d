"""Plain decoding speed: specfork vs Hugging Face transformers `generate`, one interleaved run.

Both decode the same chat-templated prompt ids greedily for exactly N new tokens (EOS ignored)
in the same dtype. Methods alternate prompt by prompt after a warm-up; medians of repeats.
Decode tokens/s is measured the same way for both: (N - 1) / (t(N tokens) - t(1 token)), so
prefill is excluded without trusting either library's own counters.

Also measured: prefill tokens/s, the cost of one target forward over 1..32 new tokens (the
verification cost curve), the fraction of the memory-bandwidth bound reached, and the peak
resident memory of a `specfork generate` run.

    python benchmarks/decode_speed.py --prompts benchmarks/prompts/specbench-dev.jsonl \
        --n-prompts 6 --max-new-tokens 128 --repeats 3 --out bench-out/decode_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specfork.bench.hf import load_hf_model
from specfork.bench.machine import machine_info
from specfork.bench.prompts import load_prompts
from specfork.config import GenerationConfig
from specfork.engine.generator import Generator
from specfork.loading.loader import load_model


def read_prompts(path: Path, n: int) -> list[tuple[str, str]]:
    """The first n prompts of a Spec-Bench file, round-robin over its categories."""
    by_cat: dict[str, list[str]] = {}
    for p in load_prompts(path):
        by_cat.setdefault(p.category, []).append(p.text)
    picked: list[tuple[str, str]] = []
    while len(picked) < n and any(by_cat.values()):  # round-robin over categories
        for cat, items in by_cat.items():
            if items and len(picked) < n:
                picked.append((cat, items.pop(0)))
    return picked


def time_specfork(gen: Generator, ids: list[int], n: int) -> float:
    cfg = GenerationConfig(max_new_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    res = gen.generate(list(ids), config=cfg)
    assert len(res.token_ids) == n, (len(res.token_ids), n)
    return time.perf_counter() - t0


def time_hf(model: object, ids: list[int], n: int) -> float:
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    assert out.shape[1] - x.shape[1] == n
    return time.perf_counter() - t0


def decode_speed(
    dtype: torch.dtype, model_path: Path, prompts: list[list[int]], n: int, repeats: int
) -> dict:
    loaded = load_model(str(model_path), dtype=dtype, device="cpu", progress=False)
    gen = Generator(loaded)
    hf = load_hf_model(model_path, dtype)
    runners = {"specfork": lambda ids, k: time_specfork(gen, ids, k),
               "hf-generate": lambda ids, k: time_hf(hf, ids, k)}  # fmt: skip
    for run in runners.values():  # warm-up
        run(prompts[0], 8)
    rates: dict[str, list[float]] = {k: [] for k in runners}
    prefill: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(repeats):
        for ids in prompts:
            for name, run in runners.items():
                t1 = run(ids, 1)
                tn = run(ids, n)
                rates[name].append((n - 1) / (tn - t1))
                prefill[name].append(len(ids) / t1)
    out = {
        name: {
            "decode_tok_s": statistics.median(rates[name]),
            "prefill_tok_s": statistics.median(prefill[name]),
        }
        for name in runners
    }
    out["speedup"] = out["specfork"]["decode_tok_s"] / out["hf-generate"]["decode_tok_s"]
    out["bandwidth"] = bandwidth_fraction(loaded.model, out["specfork"]["decode_tok_s"])
    out["forward_cost_ms"] = forward_cost(loaded.model)
    return out


def bandwidth_fraction(model: torch.nn.Module, tok_s: float) -> dict:
    """Weight bytes read per token × tokens/s, against a measured copy bandwidth."""
    seen: set[int] = set()
    weight_bytes = 0
    for name, p in model.named_parameters():
        if id(p) in seen or (name == "embed_tokens.weight" and not model.config.tie_embeddings):
            continue  # an untied embedding is only gathered, one row per token
        seen.add(id(p))
        weight_bytes += p.numel() * p.element_size()
    src = torch.empty(256 * 2**20, dtype=torch.uint8)  # 256 MiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    copy_gbs = 2 * src.numel() / min(times) / 1e9  # read + write
    achieved = weight_bytes * tok_s / 1e9
    return {"weight_mb": weight_bytes / 1e6, "achieved_gb_s": achieved,
            "copy_gb_s": copy_gbs, "fraction": achieved / copy_gbs}  # fmt: skip


def forward_cost(model: torch.nn.Module, context: int = 256, repeats: int = 15) -> dict:
    """Median ms of one forward (plus LM head on every new row) over T new tokens."""
    cache = model.new_cache(context + 64)
    costs = {}
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, context)), torch.arange(context), cache)
        for t in (1, 4, 8, 16, 32):
            times = []
            for _ in range(repeats):
                cache.truncate(context)
                toks = torch.randint(0, 1000, (1, t))
                t0 = time.perf_counter()
                model.logits(model(toks, torch.arange(context, context + t), cache))
                times.append(time.perf_counter() - t0)
            costs[t] = statistics.median(times) * 1e3
    return costs


PEAK_PROBE = """
import runpy, sys
sys.argv = ["specfork", *sys.argv[1:]]
try:
    runpy.run_module("specfork.cli", run_name="__main__")
except SystemExit:
    pass
for line in open("/proc/self/status"):
    if line.startswith("VmHWM"):
        print(int(line.split()[1]) // 1024, file=sys.stderr)
"""


def peak_memory_mb(model: str) -> float:
    """Peak RSS (VmHWM, reset by exec) of a whole `specfork generate` run, default dtype."""
    cmd = [sys.executable, "-c", PEAK_PROBE, "generate", "--model", model, "-q",
           "-n", "64", "What is the capital of France?"]  # fmt: skip
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return float(proc.stderr.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=Path, default=Path("benchmarks/prompts/specbench-dev.jsonl"))
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", type=Path, default=Path("bench-out/decode_speed.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_model(args.model, dtype=torch.float32, device="cpu", progress=False)
    gen = Generator(loaded)
    prompts = [gen.encode_prompt(p) for _, p in read_prompts(args.prompts, args.n_prompts)]
    del gen, loaded
    result = {
        "machine": machine_info(),
        "prompt_tokens": [len(p) for p in prompts],
        "max_new_tokens": args.max_new_tokens,
    }  # fmt: skip
    from specfork.loading.registry import resolve_model

    path = resolve_model(args.model)
    for name in args.dtypes.split(","):
        dt = getattr(torch, name)
        result[name] = decode_speed(dt, path, prompts, args.max_new_tokens, args.repeats)
        print(name, json.dumps(result[name], indent=1), flush=True)
    result["peak_rss_mb"] = peak_memory_mb(args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
