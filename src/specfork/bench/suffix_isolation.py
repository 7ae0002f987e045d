"""Honest measurement of drafters that learn across requests (`--drafter suffix`).

A suffix index learns from every request it sees. Left alone in a benchmark it would draft a
prompt from another strategy's run of the same prompt, or a repeat from the previous repeat's
output: figures no user gets. So each strategy that drafts with it runs on a Generator of its
own (its own index, shared with no other strategy), and before every repeat of a turn its index
is put back to what it held before that turn's first repeat: a run learns only from the turns
this strategy ran before it (the warm-up and earlier prompts), never from the prompt itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specfork.bench.records import PreparedPrompt, RunOutput
from specfork.drafters.suffix_index import Snapshot, SuffixIndex

NOTE = (
    "suffix-index strategies run on a Generator of their own; before every repeat of a turn "
    "their index is reset to what it held before the turn's first repeat, so a run drafts from "
    "earlier prompts (and the warm-up) of the same strategy only"
)


class TurnReset:
    """Puts an index back to its state before the current turn's first run, at every repeat."""

    def __init__(self, index: SuffixIndex) -> None:
        self.index = index
        self._turn: tuple[int, int] | None = None
        self._before: Snapshot | None = None

    def before_run(self, p: PreparedPrompt) -> None:
        """Called before each run: a new turn is remembered, a repeat starts from it."""
        turn = (p.index, p.turn)
        if turn != self._turn or self._before is None:
            self._turn, self._before = turn, self.index.snapshot()
        else:
            self.index.restore(self._before)


def isolated_runner(
    index: SuffixIndex, run: Callable[[list[int]], RunOutput]
) -> Callable[[Any], RunOutput]:
    """`run` (on a prompt's ids) as a runner of PreparedPrompts that resets `index` per turn
    (a `BenchStrategy` with `takes_prompt`)."""
    reset = TurnReset(index)

    def run_prompt(p: PreparedPrompt) -> RunOutput:
        reset.before_run(p)
        return run(list(p.ids))

    return run_prompt
