"""Draft policies: the shape of the next draft (for chains, its length K) from the past.

A policy sees only the past (acceptance history, the target's logits from the last
verification) and never changes the output distribution — only how much is drafted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specfork.checks import is_int
from specfork.config import POLICY_NAMES
from specfork.drafters.base import DraftShape
from specfork.errors import ConfigError


@dataclass(frozen=True, slots=True)
class RoundInfo:
    """What one verification round did; what a policy learns from."""

    drafted: int
    accepted: int
    generated: int  # output tokens so far, this round's included
    target_logits: torch.Tensor | None = None  # [N + 1, V] from the verification forward
    fork: int | None = None  # the root's child (sibling rank) that won; None = none
    tree_depth: int = 0  # depth of the deepest verified node (a chain: its length)


class DraftPolicy(Protocol):
    """Chooses the shape of the next draft."""

    name: str

    def begin(self) -> DraftPolicy:
        """The policy of a new request: a fresh one, or itself when it keeps no state."""

    def next_shape(self, generated: int) -> DraftShape:
        """The next round's draft shape (`generated` output tokens so far)."""

    def update(self, info: RoundInfo) -> None:
        """Learn from the round that just finished."""

    def trace(self) -> dict[str, float | int | bool]:
        """Extra fields for this round's trace record (what the last update computed)."""


def check_policy(policy: object) -> None:
    """Raise ConfigError naming what a custom policy lacks of the `DraftPolicy` protocol."""
    members = ("name", "begin", "next_shape", "update", "trace")
    missing = [m for m in members if not hasattr(policy, m)]
    if missing:
        raise ConfigError(
            f"the policy {type(policy).__name__} lacks {', '.join(missing)} of the DraftPolicy "
            "protocol (specfork.strategies.policies.DraftPolicy): give it name, begin() (a "
            "fresh policy for a new request, or itself), next_shape(), update() and trace()"
        )


def _check_k(k: int, name: str = "k") -> None:
    if not is_int(k) or k < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {k}")


class ConstantK:
    """Always draft K tokens."""

    name = "constant"

    def __init__(self, k: int) -> None:
        _check_k(k)
        self.k = k

    def begin(self) -> ConstantK:
        return self

    def next_shape(self, generated: int) -> DraftShape:
        return DraftShape(self.k)

    def update(self, info: RoundInfo) -> None:
        return None

    def trace(self) -> dict[str, float | int | bool]:
        return {}


class HeuristicK:
    """+2 after a fully accepted round, -1 otherwise, within [1, k_max] (HF's heuristic)."""

    name = "heuristic"

    def __init__(self, k: int, k_max: int | None = None) -> None:
        _check_k(k)
        self.k_max = 2 * k if k_max is None else k_max
        _check_k(self.k_max, "k_max")
        if k > self.k_max:
            raise ConfigError(f"the starting k ({k}) must not exceed k_max ({self.k_max})")
        self.k_start = k
        self.k = k

    def begin(self) -> HeuristicK:
        return HeuristicK(self.k_start, self.k_max)

    def next_shape(self, generated: int) -> DraftShape:
        return DraftShape(self.k)

    def update(self, info: RoundInfo) -> None:
        if info.drafted == 0:
            return
        full = info.accepted == info.drafted
        self.k = min(self.k_max, self.k + 2) if full else max(1, self.k - 1)

    def trace(self) -> dict[str, float | int | bool]:
        return {"next_k": self.k}


class LinearDecayK:
    """K_t = max(1, round(K_max * (1 - t / T))), T the expected output length."""

    name = "linear-decay"

    def __init__(self, k_max: int, expected_length: int) -> None:
        _check_k(k_max, "k_max")
        _check_k(expected_length, "expected output length")
        self.k_max = k_max
        self.expected = expected_length

    def begin(self) -> LinearDecayK:
        return self

    def next_shape(self, generated: int) -> DraftShape:
        return DraftShape(max(1, round(self.k_max * (1 - generated / self.expected))))

    def update(self, info: RoundInfo) -> None:
        return None

    def trace(self) -> dict[str, float | int | bool]:
        return {}


POLICIES = POLICY_NAMES


def make_policy(name: str, k: int, expected_length: int) -> DraftPolicy:
    """A policy by name; `k` is its K (the maximum for linear-decay)."""
    if name == "constant":
        return ConstantK(k)
    if name == "heuristic":
        return HeuristicK(k)
    if name == "linear-decay":
        return LinearDecayK(k, expected_length)
    raise ConfigError(f"unknown draft-length policy {name!r}; choose one of {', '.join(POLICIES)}")
