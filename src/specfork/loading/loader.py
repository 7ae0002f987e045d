"""Load a model by packaged name, GGUF file or checkpoint folder."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from specfork.config import ModelConfig
from specfork.errors import ConfigError, ModelFormatError
from specfork.host import cache_dir, cpu_flags
from specfork.kernels import kernel_status
from specfork.loading import fast as fast_loader
from specfork.loading import gguf as gguf_loader
from specfork.loading import safetensors as st_loader
from specfork.loading import weight_cache
from specfork.loading.gguf_index import GGUFIndex, load_index
from specfork.loading.hub import hub_label
from specfork.loading.registry import resolve_model
from specfork.loading.tokenizer import Tokenizer
from specfork.models import DecoderLM, build_model
from specfork.models.fast import FastLM, fits_kernels
from specfork.models.target import TargetModel
from specfork.threads import apply_torch, parse_threads

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: What `--dtype` accepts besides "auto": the torch dtypes, and "gguf" (a GGUF's own blocks).
PRECISIONS = (*DTYPES, "gguf")


@dataclass
class LoadedModel:
    """A model ready to run, its tokenizer, and where it came from."""

    model: TargetModel
    tokenizer: Tokenizer
    path: Path
    load_seconds: float
    thread_id: int = field(default_factory=threading.get_ident)  # the thread that loaded it

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def label(self) -> str:
        """The model's name for humans: ``org/name`` for a Hub model, else the file or folder
        name."""
        return hub_label(self.path) or self.path.name


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' → CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA GPU is available; use cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"unknown device {device!r}; use auto, cpu or cuda[:N]") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported; use auto, cpu or cuda[:N]")
    return dev


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 dot products (AVX-512 BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype of a float precision; 'auto' picks bf16 where it is fast (CUDA with
    bf16, CPUs with AVX-512 BF16/AMX), else fp16 (CUDA) or fp32."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; use auto, {', '.join(PRECISIONS)}")
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def resolve_precision(
    dtype: str | torch.dtype,
    device: torch.device,
    path: Path,
    kernels: ModuleType | None,
    index: GGUFIndex | None = None,
) -> str:
    """The precision a model runs in: a `--dtype` value, or for 'auto' the fastest here.

    On the CPU with the kernels, a GGUF whose weights the kernels run as stored runs at its own
    precision ("gguf": llama.cpp's model and numerics, the fastest; docs/benchmarks.md);
    anything else in bf16 where the CPU has bf16 dot products, else fp32. `index`: the file's
    header already read (else it is read here when needed).
    """
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in ("auto", *PRECISIONS):
        raise ConfigError(f"unknown dtype {dtype!r}; use auto, {', '.join(PRECISIONS)}")
    if dtype == "gguf" and (path.is_dir() or device.type != "cpu"):
        raise ConfigError(
            "--dtype gguf runs a .gguf file's own weights on the CPU; "
            "use bfloat16 or float32 for this model"
        )
    if dtype != "auto":
        return dtype
    if kernels is not None and device.type == "cpu" and path.is_file():
        why = fast_loader.unsupported(index or load_index(path, cache_dir() / "weights"))
        if why is None:
            return "gguf"
        log.info("%s runs in bfloat16/float32: %s", path.name, why)
    return str(resolve_dtype("auto", device)).removeprefix("torch.")


def kernels_for(device: torch.device, wanted: bool | None) -> ModuleType | None:
    """The compiled kernels when they should run: on the CPU, unless `wanted` is False.

    None (auto) uses them where they have a vector path for this CPU; True insists on them
    (ConfigError when they cannot be built or loaded).
    """
    if wanted is False or device.type != "cpu":
        if wanted and device.type != "cpu":
            raise ConfigError("specfork's kernels run on the CPU; use --device cpu")
        return None
    module, why = kernel_status()
    if module is None and wanted:
        raise ConfigError(f"specfork's compiled kernels are not available here: {why}")
    if module is not None and wanted is None and module.isa() == "generic":
        log.info("the kernels have no vector code for this CPU; the eager PyTorch path runs")
        return None
    return module


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    progress: bool = True,
    kernels: bool | None = None,
    threads: int | str | None = None,
) -> LoadedModel:
    """Load weights and tokenizer; `name_or_path` is a .gguf file, a checkpoint folder, a
    packaged name or a Hugging Face Hub id (precedence: `registry.resolve_model`).

    `dtype`: auto, float32, bfloat16, float16 or gguf (a GGUF's own quantized weights).
    `kernels`: run on specfork's compiled CPU kernels (None: where they help; see
    `kernels_for`); they are batch-invariant, so speculative output is bitwise plain output.
    `threads`: how many threads compute (None or "auto": the usable cores, fewer while other
    jobs keep them busy; a number: exactly that many); process-wide (`specfork.threads`).
    """
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str):
        raise ConfigError(
            f"a model is named by a string or a path (a .gguf file, a folder, a packaged name), "
            f"got {type(name_or_path).__name__}"
        )
    if kernels is not None and not isinstance(kernels, bool):
        raise ConfigError(f"kernels must be True, False or None (where they help), got {kernels!r}")
    setting = parse_threads(threads)
    apply_torch(setting)  # loading runs PyTorch operators too
    t0 = time.perf_counter()
    path = resolve_model(name_or_path, progress=progress)
    model = load_decoder(path, dtype=dtype, device=device, kernels=kernels)
    model.set_threads(setting)
    if path.is_dir():
        tokenizer = Tokenizer.from_folder(path)
    else:
        tokenizer = Tokenizer.from_gguf(path, cache_dir() / "tokenizers")
    seconds = time.perf_counter() - t0
    loaded = LoadedModel(model=model, tokenizer=tokenizer, path=path, load_seconds=seconds)
    log.info(
        "loaded %s (%s, %s) in %.2f s", loaded.label, model.describe(), setting.describe(), seconds
    )
    return loaded


def load_decoder(
    path: Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    kernels: bool | None = None,
) -> TargetModel:
    """The model of a .gguf file or a checkpoint folder, without its tokenizer.

    On the kernels (see `load_model`) unless they are off or unavailable; else eager PyTorch.
    A GGUF's header is read once and kept in the cache folder (`gguf_index`), and a GGUF packed
    for the kernels is read back from the cache (`packed_cache`): a second load of a file
    parses neither its metadata nor its tensors.
    """
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    module = kernels_for(dev, kernels)
    folder = cache_dir() / "weights"
    index = load_index(path, folder) if path.is_file() else None
    precision = resolve_precision(dtype, dev, path, module, index)
    if precision == "gguf" and module is None:
        raise ConfigError(
            "--dtype gguf runs on specfork's compiled kernels, which are off "
            "or not available here; use --dtype bfloat16 or float32"
        )
    on_kernels = module is not None and precision in fast_loader.FLOAT_KINDS
    if on_kernels and index is not None:
        why = fits_kernels(gguf_loader.config_from_gguf(index, path))
        if why is None:
            return fast_loader.load_gguf_fast(path, module, index, folder, precision)
        log.info("%s runs on the eager path: %s", path.name, why)
        return load_eager(path, DTYPES[precision], dev, index=index)
    model = load_eager(path, DTYPES[precision], dev, relayout=not on_kernels)
    if on_kernels:
        why = fits_kernels(model.config)
        if why is None:
            return FastLM.from_decoder(module, model, precision)
        log.info("%s runs on the eager path: %s", path.name, why)
        model = load_eager(path, DTYPES[precision], dev)
    return model


def load_eager(
    path: Path,
    dt: torch.dtype,
    dev: torch.device,
    relayout: bool = True,
    index: GGUFIndex | None = None,
) -> DecoderLM:
    """The eager PyTorch model (converted GGUF weights are cached, see `weight_cache`).

    `relayout` stores the weights the way the eager CPU kernels run fastest; `index`: a GGUF's
    header already read.
    """
    if path.is_dir():
        cfg = st_loader.config_from_hf(st_loader.read_config(path))
        model = _skeleton(cfg)
        weights = model.from_hf_names(dict(st_loader.iter_tensors(path, dt)))
    else:
        cached_at = weight_cache.cache_file(cache_dir() / "weights", path, dt)
        cfg, weights = weight_cache.read(cached_at) or _convert_gguf(path, dt, index)
        model = _skeleton(cfg)
    try:
        model.load_weights({k: v.to(dev) for k, v in weights.items()}, assign=True)
    except (KeyError, RuntimeError) as exc:
        raise ModelFormatError(f"{path}: weights do not match the model config: {exc}") from exc
    if path.is_file() and not cached_at.exists():
        weight_cache.write(cached_at, cfg, weights, path)  # only weights that loaded are cached
    weights.clear()  # the model owns its tensors now; re-layouts below may free the originals
    for rotary in (model.rotary, model.rotary_local):
        if rotary is not None:
            rotary.reset_inv_freq(dev)
    if relayout and dev.type == "cpu" and dt == torch.float32:
        model.use_column_major_weights()
    if relayout and dev.type == "cpu" and dt == torch.bfloat16:
        model.use_packed_weights()
    return model.eval().requires_grad_(False)


def _skeleton(cfg: ModelConfig) -> DecoderLM:
    """The model with no storage allocated (weights are adopted by `load_weights`)."""
    with torch.device("meta"):
        return build_model(cfg)


def _convert_gguf(
    path: Path, dtype: torch.dtype, index: GGUFIndex | None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    index = index or load_index(path, cache_dir() / "weights")
    cfg = gguf_loader.config_from_gguf(index, path)
    hf_named = dict(gguf_loader.iter_tensors(index, cfg, dtype))
    return cfg, _skeleton(cfg).from_hf_names(hf_named)
