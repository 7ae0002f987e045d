"""The benchmark's live progress bar (rich, on stderr)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)


class LiveProgress:
    """A rich progress bar (stderr): the current prompt and strategy, running speedups."""

    def __init__(self, console: Console | None, enabled: bool = True) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}\n[dim]{task.fields[speedups]}"),
            console=console,
            disable=not enabled,
            transient=False,
        )
        self._task: Any = None

    @contextmanager
    def running(self, total: int) -> Iterator[LiveProgress]:
        with self._progress:
            self._task = self._progress.add_task("warm-up", total=total, speedups="")
            yield self

    def describe(self, text: str) -> None:
        if self._task is not None:
            self._progress.update(self._task, description=escape(text))

    def advance(self) -> None:
        if self._task is not None:
            self._progress.advance(self._task)

    def speedups(self, values: Mapping[str, float]) -> None:
        if self._task is not None:
            text = "speedups so far: " + ", ".join(f"{k} {v:.2f}×" for k, v in values.items())
            self._progress.update(self._task, speedups=escape(text))
