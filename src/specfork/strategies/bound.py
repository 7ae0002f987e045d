"""How many tokens a strategy may draft in one round, from its settings: the work a request can
cause per round (the server bounds it), with the settings it follows from. One function per
kind of strategy; `registry` names each strategy's."""

from __future__ import annotations

from specfork.config import SpecConfig


def no_draft_bound(spec: SpecConfig) -> tuple[int, str]:
    """Plain decoding drafts nothing."""
    return 0, "plain decoding drafts nothing"


def chain_bound(spec: SpecConfig) -> tuple[int, str]:
    """A chain is at most its strategy's longest draft (speculative's k, DSpark's max_k)."""
    name = spec.strategy_kind.longest
    n = spec.draft_k
    return n, f"{name}={n}"


def tree_bound(spec: SpecConfig) -> tuple[int, str]:
    """SPORK's tree: forks × depth (each up to twice the setting when it adapts), or its
    budget for dynamic trees, whichever is more."""
    grow = 2 if spec.adapt else 1  # SporkPolicy adapts forks and depth up to twice the setting
    forks, depth = grow * spec.forks, grow * spec.depth
    how = f"forks {forks} × depth {depth}" + (" (adapt doubles both)" if spec.adapt else "")
    if spec.tree == "dynamic":
        return max(spec.budget, forks * depth), f"budget {spec.budget}, {how}"
    return forks * depth, how
