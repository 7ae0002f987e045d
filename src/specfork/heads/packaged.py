"""Draft heads shipped inside the package, found by the target they were trained for.

A shipped head lives in `packaged_heads/<model>/` (head.json, head.safetensors in bf16), where
`<model>` is the packaged model's name (`smollm2-135m-instruct`). It is found for a target whose
file or folder path names that model, case-insensitively: the packaged GGUF
(`SmolLM2-135M-Instruct.Q4_1.gguf`), a checkpoint folder `SmolLM2-135M-Instruct/` or a Hugging
Face cache snapshot of `HuggingFaceTB/SmolLM2-135M-Instruct`; `load_head` then checks that the
shapes agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from specfork.errors import ConfigError

if TYPE_CHECKING:
    from specfork.loading.loader import LoadedModel

PACKAGED = Path(__file__).parent / "packaged_heads"


def shipped(root: Path = PACKAGED) -> list[str]:
    """The models a head ships for (folders of `root` holding a head)."""
    return sorted(p.name for p in root.glob("*") if (p / "head.json").is_file())


def packaged_head(target: LoadedModel | Path, root: Path = PACKAGED) -> Path:
    """The folder of the head shipped (in `root`) for `target` (a loaded model or its file or
    folder); ConfigError if none."""
    path = Path(target) if isinstance(target, Path) else Path(target.path)
    where = str(path.resolve()).lower()
    names = shipped(root)
    for name in sorted(names, key=len, reverse=True):  # the most specific name first
        if name.lower() in where:
            return root / name
    raise ConfigError(
        f"no draft head ships for {path.name} (shipped for: "
        f"{', '.join(names) or 'none yet'}); train one with `specfork train-head -m MODEL "
        "--out DIR` and use --drafter head:DIR"
    )


def head_folder(value: str | Path, target: LoadedModel | Path) -> Path:
    """A head folder named on the command line: a path, or `packaged` (unless a folder of that
    name exists) for the head shipped for `target`."""
    path = Path(value)
    return packaged_head(target) if str(value) == "packaged" and not path.exists() else path
