"""Hugging Face transformers baselines: ``generate`` plain, with prompt lookup, assisted.

They load the same weights as specfork (a GGUF file through ``from_pretrained(gguf_file=...)``
or the same checkpoint folder), in the same dtype and on the same device, and get the same
prompt token ids. transformers is imported only when a baseline is built; without it the
baselines are skipped with a note. A GGUF target also needs accelerate (transformers reads GGUF
files through it): ``pip install "specfork[bench]"``; without it the baselines are skipped
with that command.

Decode tokens/s is measured without trusting transformers' own counters:
(n − 1) / (t(n tokens) − t(1 token)) on the same prompt, so prefill is excluded; time to first
token is t(1 token). Acceptance and forward counts are not available (n/a).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from specfork.bench.records import BenchStrategy, RunOutput
from specfork.bench.specs import StrategySpec
from specfork.config import SamplingParams
from specfork.extras import MissingDependencyError, require
from specfork.steps import long_step
from specfork.threads import torch_threads

log = logging.getLogger(__name__)

DEFAULT_PROMPT_LOOKUP = 10  # transformers' documented example value of prompt_lookup_num_tokens


def transformers_available() -> bool:
    """True when transformers can be imported."""
    return importlib.util.find_spec("transformers") is not None


class HFModels:
    """Loaded transformers models, one per (path, dtype, device): baselines share them."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._models: dict[Path, Any] = {}

    def get(self, path: Path) -> Any:
        if path not in self._models:
            self._models[path] = load_hf_model(path, self.dtype, self.device)
        return self._models[path]


def load_hf_model(path: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
    """A transformers causal LM from a .gguf file or a checkpoint folder, in eval mode.

    transformers needs accelerate to read a GGUF file (MissingDependencyError without it).
    Its GGUF conversion draws a tqdm bar that its progress switch does not reach; whatever it
    writes to stderr goes to the debug log instead, so a bench's stderr stays readable in a
    file or a CI log and the bench's own display is not broken on a terminal.
    """
    if not path.is_dir():
        require("accelerate", "transformers loading a GGUF file")
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kwargs: dict[str, Any] = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its tqdm bars would break specfork's progress display
    captured = io.StringIO()
    try:
        step = long_step(log, f"loading {path.name} in transformers", "5–30 s")
        with step, contextlib.redirect_stderr(captured):
            model = _from_pretrained(AutoModelForCausalLM, path, kwargs)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if captured.getvalue():
            log.debug("transformers wrote while loading: %s", captured.getvalue()[-2000:])
    return model.to(device).eval()


def _from_pretrained(auto_class: Any, path: Path, kwargs: dict[str, Any]) -> Any:
    if path.is_dir():
        return auto_class.from_pretrained(path, **kwargs)
    return auto_class.from_pretrained(path.parent, gguf_file=path.name, **kwargs)


def generate_kwargs(
    sampling: SamplingParams, eos_ids: Iterable[int], n: int, ignore_eos: bool
) -> dict[str, Any]:
    """`generate` arguments for specfork's sampling parameters and limits."""
    eos = sorted(eos_ids)
    kw: dict[str, Any] = {"max_new_tokens": n, "pad_token_id": eos[0] if eos else 0}
    if ignore_eos:
        kw["min_new_tokens"] = n  # transformers suppresses EOS instead of emitting it
    elif eos:
        kw["eos_token_id"] = eos
    if sampling.greedy:
        kw["do_sample"] = False
    else:
        kw.update(
            do_sample=True,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
        )
        if sampling.min_p > 0:
            kw["min_p"] = sampling.min_p
    return kw


def hf_runner(
    model: Any,
    n: int,
    eos_ids: Iterable[int],
    sampling: SamplingParams,
    *,
    ignore_eos: bool = False,
    threads: int = 1,
    **method_kwargs: Any,
) -> Callable[[list[int]], RunOutput]:
    """Measures one `generate` configuration on `threads` PyTorch threads: t(1 token), then
    t(n tokens)."""
    eos = frozenset(eos_ids)

    def generate(ids: list[int], k: int) -> tuple[float, list[int]]:
        x = torch.tensor([ids], device=model.device)
        kw = generate_kwargs(sampling, eos, k, ignore_eos)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        t0 = time.perf_counter()
        with torch.inference_mode(), torch_threads(threads):
            out = model.generate(x, attention_mask=torch.ones_like(x), **kw, **method_kwargs)
        return time.perf_counter() - t0, out[0, len(ids) :].tolist()

    def run(ids: list[int]) -> RunOutput:
        t1, _ = generate(ids, 1)
        tn, new = generate(ids, n)
        stop = next((i for i, t in enumerate(new) if t in eos), None) if not ignore_eos else None
        produced = new if stop is None else new[:stop]
        decoded = len(new) if stop is None else stop + 1  # the EOS is decoded too
        if decoded > 1 and tn > t1:
            rate = (decoded - 1) / (tn - t1)
        else:  # noise hid the difference (tiny models on busy CPUs): the whole run, a lower bound
            rate = decoded / tn if tn > 0 else 0.0
        finish = "stop" if stop is not None else "length"
        return RunOutput(
            token_ids=produced,
            new_tokens=decoded,
            decode_tokens_per_second=rate,
            time_to_first_token=t1,
            wall_seconds=t1 + tn,
            finish_reason=finish,
        )

    return run


def build_hf_strategy(
    spec: StrategySpec,
    *,
    target_path: Path,
    models: HFModels,
    n: int,
    eos_ids: Iterable[int],
    sampling: SamplingParams,
    ignore_eos: bool = False,
    default_draft: str | None = None,
    threads: int = 1,
) -> BenchStrategy:
    """A ready baseline, or one carrying the error that kept it from loading."""
    description = spec.describe()
    try:
        method_kwargs: dict[str, Any] = {}
        if spec.method == "prompt-lookup":
            method_kwargs["prompt_lookup_num_tokens"] = spec.options.get("k", DEFAULT_PROMPT_LOOKUP)
            if "max_ngram" in spec.options:
                method_kwargs["max_matching_ngram_size"] = spec.options["max_ngram"]
        elif spec.method == "assisted":
            from specfork.loading.registry import resolve_model

            draft = spec.options.get("draft") or default_draft or str(target_path)
            draft_path = resolve_model(draft, progress=False)
            description["draft"] = str(draft_path)
            method_kwargs["assistant_model"] = models.get(draft_path)
            if "k" in spec.options:
                method_kwargs["num_assistant_tokens"] = spec.options["k"]
            if "schedule" in spec.options:
                method_kwargs["num_assistant_tokens_schedule"] = spec.options["schedule"]
        model = models.get(target_path)
        description["generate_kwargs"] = {
            k: v for k, v in method_kwargs.items() if k != "assistant_model"
        }
        description["threads"] = threads
        run = hf_runner(
            model, n, eos_ids, sampling, ignore_eos=ignore_eos, threads=threads, **method_kwargs
        )
        return BenchStrategy(spec.label, "hf", run, description)
    except MissingDependencyError as exc:  # not installed: skipped, with the pip command
        error = f"{spec.label} needs {exc.extra.package}: {exc.extra.command}"
        return BenchStrategy(spec.label, "hf", None, description, error=error, skipped=True)
    except Exception as exc:
        return BenchStrategy(
            spec.label, "hf", None, description, error=f"cannot load: {type(exc).__name__}: {exc}"
        )
