"""On-disk cache of a GGUF model packed for the kernels.

Opening a GGUF with gguf-py parses every metadata field, the vocabulary's ~100,000 strings one
by one: ~3.4 s of the default model's 3.9 s load on two cores, paid by every `specfork
generate`. What the kernels run — each weight's packed blocks, the norms and biases, the
ModelConfig — is saved once as a safetensors file next to the converted weights' cache; a later
load maps it back without opening the GGUF. The key holds the file's identity, the compiled
kernels' build (their module name carries a digest of their sources) and the bytes of the
Python code that packs (`kernels/pack.py`, `loading/fast.py`), so a change to any of them
packs afresh; a new file replaces the ones packed before from the same source path (each
names its source in its metadata), so upgrades and edited files leave no stale copies. Only
files whose weights the kernels run as stored are saved.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from types import ModuleType

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from specfork.atomic import atomic_file
from specfork.config import ModelConfig
from specfork.host import source_digest
from specfork.kernels import pack
from specfork.loading.weight_cache import remove_stale

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the saved layout changes


def packed_file(folder: Path, source: Path, kernels: ModuleType, precision: str = "gguf") -> Path:
    """Where the packed model of the GGUF at `source` lives for these kernels at `precision`
    ("gguf": the file's own blocks; "bfloat16", "float32")."""
    return packed_file_for(folder, source, kernels.__name__, precision)


def packed_file_for(folder: Path, source: Path, build: str, precision: str = "gguf") -> Path:
    """`packed_file` for the kernels whose module is named `build` (loaded or not)."""
    code = hashlib.sha256()
    for module_file in (pack.__file__, Path(__file__).with_name("fast.py")):
        code.update(Path(module_file).read_bytes())
    digest = source_digest(source, FORMAT, build, code.hexdigest(), precision)
    return folder / f"{source.stem}-{packed_kind(precision)}-{digest}.safetensors"


def packed_kind(precision: str) -> str:
    """The kind a packed file's name gives: "packed" (the file's own blocks), else
    "packed_bfloat16" / "packed_float32" (no glob of one kind matches another's names)."""
    return "packed" if precision == "gguf" else f"packed_{precision}"


def precision_of(kind: str) -> str | None:
    """The precision of a packed file's kind (`packed_kind` inverted; None: not packed)."""
    if kind == "packed":
        return "gguf"
    return kind.removeprefix("packed_") if kind.startswith("packed_") else None


class PackedWeights:
    """A packed model's parts by GGUF tensor name: linears (kind, n, k, blocks, bias) and float
    vectors; recorded while a GGUF is packed, or read back from the cache."""

    def __init__(self, cfg: ModelConfig, detail: str = "") -> None:
        self.cfg, self.detail = cfg, detail  # detail: the file's weight types ("Q4_1+Q8_0")
        self.tensors: dict[str, torch.Tensor] = {}
        self.linears: dict[str, list[int]] = {}  # name -> [kind, n, k]

    def add_linear(
        self, name: str, kind: int, n: int, k: int, data: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        self.linears[name] = [int(kind), int(n), int(k)]
        self.tensors[f"{name}:data"] = data
        if bias is not None:
            self.tensors[f"{name}:bias"] = bias

    def add_vector(self, name: str, vector: torch.Tensor | None) -> None:
        if vector is not None:
            self.tensors[f"{name}:vector"] = vector

    def has(self, name: str) -> bool:
        return name in self.linears or f"{name}:vector" in self.tensors

    def vector(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(f"{name}:vector")

    def linear(self, name: str, kernels: ModuleType) -> object:
        kind, n, k = self.linears[name]
        data, bias = self.tensors[f"{name}:data"], self.tensors.get(f"{name}:bias")
        return kernels.Packed(kind, n, k, data, bias)

    def write(self, path: Path, source: Path) -> None:
        """Save atomically, then delete what was packed before from the same `source`; a
        failure to write only logs a warning (the GGUF is read again)."""
        origin = str(source.resolve())
        meta = {
            "config": json.dumps(self.cfg.to_dict()),
            "linears": json.dumps(self.linears),
            "detail": self.detail,
            "source": origin,
        }
        tensors = {k: v.contiguous() for k, v in self.tensors.items()}
        try:
            with atomic_file(path) as tmp:
                save_file(tensors, tmp, metadata=meta)
        except OSError as exc:
            log.warning("cannot cache the packed model at %s (%s)", path, exc)
            return
        remove_stale(path, source)

    @classmethod
    def read(cls, path: Path) -> PackedWeights | None:
        """The packed model saved at `path`, or None when absent or unreadable."""
        if not path.exists():
            return None
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata()
            stored = cls(ModelConfig.from_dict(json.loads(meta["config"])), meta["detail"])
            stored.linears = {k: list(v) for k, v in json.loads(meta["linears"]).items()}
            stored.tensors = load_file(path)
        except (SafetensorError, OSError, KeyError, ValueError, TypeError) as exc:
            log.warning("ignoring the unreadable packed model %s: %s", path, exc)
            return None
        missing = [n for n in stored.linears if f"{n}:data" not in stored.tensors]
        if missing:
            log.warning("ignoring the packed model %s: it lacks %s", path, missing[0])
            return None
        log.info("loaded the packed model from %s", path)
        return stored
