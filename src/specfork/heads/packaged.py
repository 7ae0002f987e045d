"""Draft heads shipped inside the package, found by the target they were trained for."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from specfork.errors import ConfigError

if TYPE_CHECKING:
    from specfork.loading.loader import LoadedModel

PACKAGED = Path(__file__).parent / "packaged_heads"


def packaged_head(target: LoadedModel) -> Path:
    """The folder of the head shipped for `target` (by its file's stem); ConfigError if none."""
    name = target.path.stem
    folder = PACKAGED / name
    if (folder / "head.json").is_file():
        return folder
    shipped = sorted(p.name for p in PACKAGED.glob("*") if (p / "head.json").is_file())
    raise ConfigError(
        f"no draft head ships for {name} (shipped: {', '.join(shipped) or 'none yet'}); train "
        "one with `specfork train-head -m MODEL --out DIR` and use --drafter head:DIR"
    )
