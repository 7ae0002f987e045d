"""Plots of per-round traces: DSpark's draft length K and confidence C against position."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specfork.errors import SpecforkError


def plot_k_trace(traces: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, title: str) -> Path:
    """K (steps) and C (points) per round against the output position, one line per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_k, ax_c) = plt.subplots(2, 1, sharex=True, figsize=(7.0, 5.0))
    for label, rounds in traces.items():
        xs = [r.get("position", i) for i, r in enumerate(rounds)]
        ax_k.step(xs, [_number(r.get("k")) for r in rounds], where="post", label=label)
        ax_c.plot(xs, [_number(r.get("confidence")) for r in rounds], marker=".", label=label)
    ax_k.set_ylabel("draft length K")
    ax_k.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_c.set_ylabel("confidence C")
    ax_c.set_xlabel("output position (tokens before the round)")
    ax_k.set_title(title)
    ax_k.legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise SpecforkError(f"cannot write the plot {path}: {exc}") from exc
    finally:
        plt.close(fig)
    return path


def _number(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan
