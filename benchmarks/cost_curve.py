"""Cost of one target forward (all layers + LM head on every row) by number of new rows.

For SmolLM2-135M-Instruct (the packaged GGUF) on specfork's kernels at the GGUF's own precision
(Q4_1/Q8_0) and in bf16, on the eager PyTorch path in bf16, and for a random-weight Llama of
about 1.1B parameters (hidden 2048, 16 layers, 32/8 heads, FFN 8192, vocab 32000: the regime
of bigger targets) on the kernels with Q4 and bf16 weights. Rows 1-32 after a 256-token
context (or each of `--contexts`: attention makes rows dearer with the context), medians; a
markdown table of milliseconds and of the ratio to one row.

    python benchmarks/cost_curve.py [--repeats 9] [--skip-1b] [--gguf-only]
        [--contexts 256 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specfork.config import ModelConfig
from specfork.kernels import load_kernels
from specfork.kernels.pack import Kind, pack_float, pack_q4, pack_q8
from specfork.loading.loader import load_model
from specfork.models.fast import FastLM, LayerWeights

ROWS = (1, 2, 4, 8, 16, 32)
CONTEXT = 256


def forward_ms(model, context: int, repeats: int) -> dict[int, float]:
    """Median ms of one forward of R new tokens (and their logits) after `context` cached ones,
    for every R in ROWS (the context is prefilled once; benchmarks/big_targets.py uses it too)."""
    cache = model.new_cache(context + max(ROWS) + 1)
    ms = {}
    with torch.inference_mode():
        model.extend([(7 * i) % 1000 + 3 for i in range(context)], cache)
        for rows in ROWS:
            tokens = torch.arange(20, 20 + rows)[None]  # [1, R]
            positions = torch.arange(context, context + rows)  # [R]
            runs = []
            for _ in range(repeats + 1):
                cache.truncate(context)
                t0 = time.perf_counter()
                model.logits(model(tokens, positions, cache)[0])
                runs.append(time.perf_counter() - t0)
            ms[rows] = statistics.median(runs[1:]) * 1e3
    return ms


def random_llama(kernels, kind: Kind) -> FastLM:
    """A ~1.1B-parameter Llama with random weights, packed as Q4 (with a Q8 head) or bf16."""
    cfg = ModelConfig(
        "llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, name="random-1b",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)

    def linear(n: int, k: int, head: bool = False) -> object:
        if kind == Kind.BF16:
            w = torch.randn(n, k, generator=gen) * k**-0.5
            return kernels.Packed(int(kind), n, k, pack_float(w, kind))
        d = torch.full((n, k // 32), 0.01, dtype=torch.float16)
        if head:
            codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
            return kernels.Packed(int(Kind.Q8), n, k, pack_q8(codes, d))
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        return kernels.Packed(int(Kind.Q4), n, k, pack_q4(codes, d, -8 * d))

    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, 32 * 64, 8 * 64
    ones = torch.ones(h)
    layers = [LayerWeights([linear(q + 2 * kv, h)], [linear(h, q)], [linear(2 * f, h)],
                           [linear(h, f)], {"attn_norm": ones, "mlp_norm": ones})
              for _ in range(cfg.num_layers)]  # fmt: skip
    head = linear(cfg.vocab_size, h, head=True)
    precision = "gguf" if kind != Kind.BF16 else "bfloat16"
    return FastLM.from_layers(kernels, cfg, precision, head, [head], ones, layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--skip-1b", action="store_true")
    ap.add_argument("--gguf-only", action="store_true", help="only SmolLM2 at its GGUF precision")
    ap.add_argument("--contexts", type=int, nargs="+", default=[CONTEXT])
    args = ap.parse_args()
    kernels = load_kernels()
    models = {
        "SmolLM2-135M, kernels, gguf (Q4_1/Q8_0)": lambda: load_model(
            "smollm2-135m-instruct", dtype="gguf", kernels=True, progress=False).model,
        "SmolLM2-135M, kernels, bf16": lambda: load_model(
            "smollm2-135m-instruct", dtype="bfloat16", kernels=True, progress=False).model,
        "SmolLM2-135M, eager PyTorch, bf16": lambda: load_model(
            "smollm2-135m-instruct", dtype="bfloat16", kernels=False, progress=False).model,
    }  # fmt: skip
    if args.gguf_only:
        models = dict(list(models.items())[:1])
    elif not args.skip_1b and kernels is not None:
        models["random Llama 1.1B, kernels, Q4_0/Q8_0"] = lambda: random_llama(kernels, Kind.Q4)
        models["random Llama 1.1B, kernels, bf16"] = lambda: random_llama(kernels, Kind.BF16)
    print("| model | context | " + " | ".join(f"{r} rows" for r in ROWS) + " |")
    print("|---|---|" + "---|" * len(ROWS))
    for name, make in models.items():
        model = make()
        for context in args.contexts:
            ms = forward_ms(model, context, args.repeats)
            cells = " | ".join(f"{ms[r]:.1f} ms ({ms[r] / ms[1]:.2f}×)" for r in ROWS)
            print(f"| {name} | {context} | {cells} |", flush=True)
        del model


if __name__ == "__main__":
    main()
