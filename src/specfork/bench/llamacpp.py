"""llama.cpp baselines (through `llama-cpp-python`): what a CPU user would run instead.

``llamacpp:ar`` is llama.cpp's plain decoding of the same GGUF file, ``llamacpp:lookup`` its
prompt lookup decoding (``LlamaPromptLookupDecoding``; options ``k`` = tokens drafted per step,
default 4, and ``max_ngram``, default 2). Both get the prompt as the same token ids specfork
runs (chat template applied), the same thread count and the same sampling settings, and are
measured the same way: time to the first token (prefill included), then decode tokens/s from
the first to the last token. The KV cache is reset before every run, so no run reuses another's
prompt.

Install with ``pip install "specfork[llamacpp]"``; llama-cpp-python compiles llama.cpp from
source (see docs/benchmarks.md for the CMAKE_ARGS that build it for these CPUs).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from specfork.bench.records import BenchStrategy, RunOutput
from specfork.bench.specs import StrategySpec
from specfork.config import SamplingParams
from specfork.extras import MissingDependencyError, require

DEFAULT_LOOKUP_K = 4
DEFAULT_LOOKUP_NGRAM = 2


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _load(
    label: str,
    path: Path,
    n_ctx: int,
    seed: int | None,
    lookup: dict[str, int] | None,
    threads: int,
) -> Any:
    Llama = require("llama_cpp", label).Llama

    kwargs: dict[str, Any] = {}
    if lookup is not None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kwargs["draft_model"] = LlamaPromptLookupDecoding(
            max_ngram_size=lookup["max_ngram"], num_pred_tokens=lookup["k"]
        )
        kwargs["logits_all"] = True  # speculation reads every row's logits
    return Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=threads,
        seed=seed if seed is not None else 0,
        verbose=False,
        **kwargs,
    )


def _sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    if sampling.greedy:
        return {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
    return {
        "temp": sampling.temperature,
        "top_k": sampling.top_k or 0,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "repeat_penalty": 1.0,
    }


def llamacpp_runner(
    llm: Any, n: int, eos_ids: Iterable[int], sampling: SamplingParams, ignore_eos: bool
) -> Callable[[list[int]], RunOutput]:
    eos = frozenset(eos_ids)
    kwargs = _sampling_kwargs(sampling)

    def run(ids: list[int]) -> RunOutput:
        llm.reset()  # never reuse the previous run's cache
        tokens: list[int] = []
        stamps: list[float] = []
        t0 = time.perf_counter()
        for token in llm.generate(ids, reset=True, **kwargs):
            stamps.append(time.perf_counter())
            tokens.append(int(token))
            if (token in eos and not ignore_eos) or len(tokens) >= n:
                break
        stopped = bool(tokens) and tokens[-1] in eos and not ignore_eos
        span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
        return RunOutput(
            token_ids=tokens[:-1] if stopped else tokens,
            new_tokens=len(tokens),
            decode_tokens_per_second=(len(tokens) - 1) / span if span > 0 else 0.0,
            time_to_first_token=stamps[0] - t0 if stamps else 0.0,
            wall_seconds=(stamps[-1] if stamps else t0) - t0,
            finish_reason="stop" if stopped else "length",
        )

    return run


def build_llamacpp_strategy(
    spec: StrategySpec,
    *,
    target_path: Path,
    n: int,
    context: int,
    eos_ids: Iterable[int],
    sampling: SamplingParams,
    ignore_eos: bool = False,
    threads: int = 1,
) -> BenchStrategy:
    """A ready llama.cpp baseline on `threads` threads, or one carrying the error that kept it
    from loading."""
    description = spec.describe()
    try:
        if target_path.is_dir():
            raise ValueError("llama.cpp runs GGUF files; this model is a checkpoint folder")
        lookup = None
        if spec.method == "lookup":
            lookup = {
                "k": spec.options.get("k", DEFAULT_LOOKUP_K),
                "max_ngram": spec.options.get("max_ngram", DEFAULT_LOOKUP_NGRAM),
            }
            description["lookup"] = lookup
        llm = _load(spec.label, target_path, context, sampling.seed, lookup, threads)
        description["threads"] = threads
        run = llamacpp_runner(llm, n, eos_ids, sampling, ignore_eos)
        return BenchStrategy(spec.label, "llamacpp", run, description)
    except MissingDependencyError as exc:  # not installed (or broken): skipped, with the command
        return BenchStrategy(
            spec.label, "llamacpp", None, description, error=str(exc), skipped=True
        )
    except Exception as exc:
        return BenchStrategy(
            spec.label,
            "llamacpp",
            None,
            description,
            error=f"cannot load: {type(exc).__name__}: {exc}",
        )
