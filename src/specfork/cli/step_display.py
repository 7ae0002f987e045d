"""Long one-time steps (`specfork.steps`) on a terminal: a spinner with the elapsed time.

The library logs a long step's start and end; on a terminal the CLI shows the start as a
spinner line that counts the seconds (or, while another live display such as the loading
status runs, as one line above it) and the end as one dim line with the time it took, instead
of the two plain log lines a pipe or a log file gets.
"""

from __future__ import annotations

import logging

from rich.console import Console
from rich.errors import LiveError
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from specfork.steps import END, START


class StepDisplay(logging.Handler):
    """A logging handler that draws `long_step` records on a rich console."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.WARNING)
        self.console = console
        self._progress: Progress | None = None

    def emit(self, record: logging.LogRecord) -> None:
        kind = getattr(record, "long_step", None)
        if kind is None:
            return
        self._stop()
        if kind == START:
            self._start(record.getMessage())
            return
        style = "dim" if kind == END else "red"
        self.console.print(record.getMessage(), style=style, markup=False, highlight=False)

    def _start(self, text: str) -> None:
        progress = Progress(
            SpinnerColumn(),
            TimeElapsedColumn(),  # first: a narrow terminal cuts the text, not the time
            TextColumn("{task.description}", markup=False),
            console=self.console,
            transient=True,
        )
        progress.add_task(text)
        try:
            progress.start()
        except LiveError:  # another display is live (the loading status): one line instead
            self.console.print(text, style="dim", markup=False, highlight=False)
            return
        self._progress = progress

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def close(self) -> None:
        self._stop()
        super().close()


def not_long_step(record: logging.LogRecord) -> bool:
    """A log filter: False for a long step's records (the display shows those)."""
    return not hasattr(record, "long_step")


def show_long_steps(console: Console) -> None:
    """Draw long steps on `console` and keep them out of the plain log lines (once per
    process: a later call replaces the earlier display)."""
    for handler in logging.getLogger().handlers:
        if not_long_step not in handler.filters:
            handler.addFilter(not_long_step)
    logger = logging.getLogger("specfork")
    for old in [h for h in logger.handlers if isinstance(h, StepDisplay)]:
        logger.removeHandler(old)
        old.close()
    logger.addHandler(StepDisplay(console))
