"""Plots of per-round traces: DSpark's draft length K and confidence C against position."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specfork.checks import is_number
from specfork.errors import SpecforkError


def plot_k_trace(traces: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, title: str) -> Path:
    """Per round against the output position: K asked for (steps; marked where the tokens left
    capped it below min_k), drafted and accepted tokens, and C with the low/high thresholds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_k, ax_c) = plt.subplots(2, 1, sharex=True, figsize=(8.0, 5.6))
    for n, (label, rounds) in enumerate(traces.items()):
        color = f"C{n % 10}"
        name = "" if len(traces) == 1 else f"{label}: "
        xs = [r.get("position", i) for i, r in enumerate(rounds)]
        ks = [_number(r.get("k")) for r in rounds]
        ax_k.step(xs, ks, where="post", color=color, label=f"{name}K asked")
        ax_k.plot(
            xs,
            [_number(r.get("drafted")) for r in rounds],
            "s",
            ms=3,
            color=color,
            alpha=0.45,
            label=f"{name}drafted",
        )
        ax_k.plot(
            xs,
            [_number(r.get("accepted")) for r in rounds],
            "o",
            ms=3,
            color=color,
            mfc="none",
            label=f"{name}accepted",
        )
        floor = next((r["min_k"] for r in rounds if "min_k" in r), None)
        capped = [(x, k) for x, k in zip(xs, ks, strict=True) if floor is not None and k < floor]
        if capped:
            ax_k.plot(
                *zip(*capped, strict=True),
                "v",
                color="black",
                ms=5,
                label="K capped by the tokens left",
            )
        ax_c.plot(
            xs, [_number(r.get("confidence")) for r in rounds], ".", color=color, label=f"{name}C"
        )
        _thresholds(ax_c, rounds)
    ax_k.set_ylabel("tokens")
    ax_k.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_c.set_ylabel("confidence C")
    ax_c.set_ylim(-0.02, 1.02)
    ax_c.set_xlabel("output position (tokens before the round)")
    ax_c.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_k.set_title(title)
    for ax in (ax_k, ax_c):
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise SpecforkError(f"cannot write the plot {path}: {exc}") from exc
    finally:
        plt.close(fig)
    return path


def _thresholds(ax: Any, rounds: Sequence[Mapping[str, Any]]) -> None:
    """DSpark's low/high lines on the C panel (traces record them)."""
    first = next((r for r in rounds if "low" in r and "high" in r), None)
    if first is None:
        return
    for key, style in (("low", ":"), ("high", "--")):
        ax.axhline(
            float(first[key]),
            color="gray",
            linestyle=style,
            linewidth=0.9,
            label=f"{key} = {first[key]}",
        )


def _number(x: Any) -> float:
    return float(x) if is_number(x) else math.nan
