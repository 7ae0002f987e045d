"""Where a GPU decoding step's time goes (eager PyTorch path).

Times plain and n-gram decoding of one prompt, profiles each with cProfile (host time per
operation: on a GPU the eager path is bound by launching kernels, not by the kernels), and
times one forward of 1, 5 and 16 rows (the verification cost curve's shape on the device).

    python benchmarks/gpu_profile.py [--device cuda] [--dtype bfloat16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.generator import Generator
from specfork.loading.loader import LoadedModel, load_model

PROMPT = "Repeat exactly: one two three, one two three, one two three."


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_decoding(model: LoadedModel, tokens: int, rows: int) -> None:
    """Wall, decode speed and the `rows` costliest host functions of each strategy."""
    config = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    for name, spec in [("ar", SpecConfig()), ("ngram", SpecConfig("speculative", "ngram", k=4))]:
        gen = Generator(model, spec=spec)
        gen.generate(PROMPT, config=config)  # warm-up
        start = time.perf_counter()
        result = gen.generate(PROMPT, config=config)
        wall = time.perf_counter() - start
        s = result.stats
        print(
            f"{name}: wall {wall:.3f} s, decode {s.new_tokens / s.decode_seconds:.1f} tok/s, "
            f"{s.target_forwards} target forwards"
        )
        profiler = cProfile.Profile()
        profiler.enable()
        gen.generate(PROMPT, config=config)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
        print(text.getvalue())


def time_forwards(model: LoadedModel, sizes: tuple[int, ...], repeats: int = 20) -> None:
    """Milliseconds of one forward of each row count over a 100-token context."""
    lm, device = model.model, model.model.device
    with torch.inference_mode():
        for rows in sizes:
            cache = lm.new_cache(512)
            lm.extend(list(range(100, 200)), cache)
            ids = torch.arange(300, 300 + rows, device=device)[None]  # [1, rows]
            for _ in range(2):  # the first pass warms up, the second is timed
                _sync(device)
                start = time.perf_counter()
                for _ in range(repeats):
                    pos = torch.arange(cache.length, cache.length + rows, device=device)  # [rows]
                    lm.forward_capturing(ids, pos, cache, None, capture=())
                    cache.truncate(100)
                _sync(device)
            print(f"forward of {rows} rows: {(time.perf_counter() - start) / repeats * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=22, help="functions listed per profile")
    args = parser.parse_args()
    model = load_model(
        "smollm2-135m-instruct",
        dtype=args.dtype,
        device=args.device,
        kernels=None,
        progress=False,
    )
    profile_decoding(model, args.tokens, args.rows)
    time_forwards(model, (1, 5, 16))


if __name__ == "__main__":
    main()
