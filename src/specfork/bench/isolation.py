"""Honest measurement of what strategies learn across requests.

Two stores learn from every request a Generator runs: the suffix index (`--drafter suffix`)
and each strategy's acceptance rates, which its goodput gates start from
(`strategies.rate_memory`). Left alone in a benchmark they would draft a prompt from another
strategy's run of the same prompt, or let a repeat start from what the previous repeat learned:
figures no user gets. So each strategy that drafts with a suffix index runs on a Generator of
its own (its own index, shared with no other strategy), every strategy's rates are its own
(kept per strategy), and before every repeat of a turn both are put back to what they held
before that turn's first repeat: a run learns only from the turns this strategy ran before it
(the warm-up and earlier prompts), never from the prompt itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from specfork.bench.records import PreparedPrompt, RunOutput

SUFFIX_NOTE = (
    "suffix-index strategies run on a Generator of their own; before every repeat of a turn "
    "their index is reset to what it held before the turn's first repeat, so a run drafts from "
    "earlier prompts (and the warm-up) of the same strategy only"
)
RATES_NOTE = (
    "goodput gates start from the acceptance rates of the same strategy's earlier prompts "
    "(and the warm-up); before every repeat of a turn those are reset to what they were before "
    "the turn's first repeat"
)


class Store(Protocol):
    """What learns across requests and can be put back (a suffix index, a rate memory)."""

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> None: ...


class TurnReset:
    """Puts stores back to their state before the current turn's first run, at every repeat."""

    def __init__(self, *stores: Store) -> None:
        self.stores = stores
        self._turn: tuple[int, int] | None = None
        self._before: list[Any] | None = None

    def before_run(self, p: PreparedPrompt) -> None:
        """Called before each run: a new turn is remembered, a repeat starts from it."""
        turn = (p.index, p.turn)
        if turn != self._turn or self._before is None:
            self._turn, self._before = turn, [s.snapshot() for s in self.stores]
        else:
            for store, before in zip(self.stores, self._before, strict=True):
                store.restore(before)


def isolated_runner(
    stores: Sequence[Store], run: Callable[[list[int]], RunOutput]
) -> Callable[[Any], RunOutput]:
    """`run` (on a prompt's ids) as a runner of PreparedPrompts that resets `stores` per turn
    (a `BenchStrategy` with `takes_prompt`)."""
    reset = TurnReset(*stores)

    def run_prompt(p: PreparedPrompt) -> RunOutput:
        reset.before_run(p)
        return run(list(p.ids))

    return run_prompt
