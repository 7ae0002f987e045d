"""Load a model by packaged name, GGUF file or checkpoint folder."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specfork.config import ModelConfig
from specfork.errors import ConfigError, ModelFormatError
from specfork.loading import gguf as gguf_loader
from specfork.loading import safetensors as st_loader
from specfork.loading import weight_cache
from specfork.loading.registry import cache_dir, resolve_model
from specfork.loading.tokenizer import Tokenizer
from specfork.models import DecoderLM, build_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready to run, its tokenizer, and where it came from."""

    model: DecoderLM
    tokenizer: Tokenizer
    path: Path
    load_seconds: float
    thread_id: int = field(default_factory=threading.get_ident)  # the thread that loaded it

    @property
    def config(self) -> ModelConfig:
        return self.model.config


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
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' picks bf16 where it is fast (CUDA with bf16, CPUs with AVX-512 BF16/AMX).

    On the 2-core AVX-512-BF16 development CPU, bf16 verifies 8 tokens in about the time of
    one while fp32 needs about twice as long (docs/benchmarks.md), so bf16 is the default there.
    """
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def load_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    progress: bool = True,
) -> LoadedModel:
    """Load weights and tokenizer; `name_or_path` is a packaged name, a .gguf or a folder."""
    t0 = time.perf_counter()
    path = resolve_model(name_or_path, progress=progress)
    model = load_decoder(path, dtype=dtype, device=device)
    if path.is_dir():
        tokenizer = Tokenizer.from_folder(path)
    else:
        tokenizer = Tokenizer.from_gguf(path, cache_dir() / "tokenizers")
    seconds = time.perf_counter() - t0
    log.info("loaded %s (%s, %s) in %.2f s", path.name, model.dtype, model.device, seconds)
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, load_seconds=seconds)


def load_decoder(
    path: Path, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto"
) -> DecoderLM:
    """The model of a .gguf file or a checkpoint folder, without its tokenizer.

    Converted GGUF weights are cached (see `weight_cache`), so a second load is fast.
    """
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    dt = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, dev)
    if path.is_dir():
        cfg = st_loader.config_from_hf(st_loader.read_config(path))
        model = _skeleton(cfg)
        weights = model.from_hf_names(dict(st_loader.iter_tensors(path, dt)))
    else:
        cached_at = weight_cache.cache_file(cache_dir() / "weights", path, dt)
        cfg, weights = weight_cache.read(cached_at) or _convert_gguf(path, dt)
        model = _skeleton(cfg)
    try:
        model.load_weights({k: v.to(dev) for k, v in weights.items()}, assign=True)
    except (KeyError, RuntimeError) as exc:
        raise ModelFormatError(f"{path}: weights do not match the model config: {exc}") from exc
    if path.is_file() and not cached_at.exists():
        weight_cache.write(cached_at, cfg, weights)  # only weights that loaded are cached
    weights.clear()  # the model owns its tensors now; re-layouts below may free the originals
    for rotary in (model.rotary, model.rotary_local):
        if rotary is not None:
            rotary.reset_inv_freq(dev)
    if dev.type == "cpu" and dt == torch.float32:
        model.use_column_major_weights()
    if dev.type == "cpu" and dt == torch.bfloat16:
        model.use_packed_weights()
    return model.eval().requires_grad_(False)


def _skeleton(cfg: ModelConfig) -> DecoderLM:
    """The model with no storage allocated (weights are adopted by `load_weights`)."""
    with torch.device("meta"):
        return build_model(cfg)


def _convert_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = gguf_loader.open_gguf(path)
    cfg = gguf_loader.config_from_gguf(reader, path)
    hf_named = dict(gguf_loader.iter_tensors(reader, cfg, dtype))
    return cfg, _skeleton(cfg).from_hf_names(hf_named)
