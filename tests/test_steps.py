"""Long one-time steps (specfork/steps.py) and how the CLI draws them (cli/step_display.py)."""

from __future__ import annotations

import io
import logging

import pytest
from rich.console import Console

from specfork.cli.step_display import StepDisplay, not_long_step, show_long_steps
from specfork.steps import END, FAILED, START, long_step

log = logging.getLogger("specfork.test_steps")


def test_a_step_logs_its_start_and_its_end(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="specfork"), long_step(log, "baking", "2 s"):
        pass
    kinds = [getattr(r, "long_step", None) for r in caplog.records]
    assert kinds == [START, END]
    assert caplog.records[0].getMessage() == "baking (2 s)…"
    assert caplog.records[1].getMessage().startswith("baking: done in ")
    assert all(r.step == "baking" for r in caplog.records)


def test_a_failing_step_says_so_and_raises(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="specfork"),
        pytest.raises(OSError, match="disk full"),
        long_step(log, "baking", "2 s"),
    ):
        raise OSError("disk full")
    assert [getattr(r, "long_step", None) for r in caplog.records] == [START, FAILED]
    assert caplog.records[-1].getMessage() == "baking failed"


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=100, color_system=None), out


def test_the_display_draws_a_step_and_its_time() -> None:
    console, out = _terminal()
    display = StepDisplay(console)
    logger = logging.getLogger("specfork.test_steps.display")
    logger.propagate = False
    logger.addHandler(display)
    try:
        with long_step(logger, "baking", "2 s"):
            assert display._progress is not None  # a live spinner while the step runs
        assert display._progress is None
        logger.warning("an ordinary warning")  # not a step: the display ignores it
    finally:
        logger.removeHandler(display)
        display.close()
    text = out.getvalue()
    assert "baking (2 s)…" in text and "baking: done in 0 s" in text
    assert "ordinary" not in text


def test_beside_another_live_display_a_step_still_shows() -> None:
    """Inside the loading status (rich nests live displays from 14 on; before, one line)."""
    console, out = _terminal()
    display = StepDisplay(console)
    logger = logging.getLogger("specfork.test_steps.beside")
    logger.propagate = False
    logger.addHandler(display)
    try:
        with console.status("loading…"), long_step(logger, "baking", "2 s"):
            pass
    finally:
        logger.removeHandler(display)
        display.close()
    assert "baking: done in 0 s" in out.getvalue()  # (the spinner drew nothing in 0 s)


def test_showing_steps_twice_keeps_one_display() -> None:
    root, specfork = logging.getLogger(), logging.getLogger("specfork")
    handler = logging.StreamHandler(io.StringIO())
    root.addHandler(handler)
    try:
        show_long_steps(_terminal()[0])
        show_long_steps(_terminal()[0])
        assert sum(isinstance(h, StepDisplay) for h in specfork.handlers) == 1
        assert handler.filters.count(not_long_step) == 1
        record = logging.LogRecord("specfork.x", logging.WARNING, "", 0, "m", None, None)
        assert handler.filter(record)
        record.long_step = START
        assert not handler.filter(record)  # the plain log line leaves it to the display
    finally:
        root.removeHandler(handler)
        for h in [h for h in specfork.handlers if isinstance(h, StepDisplay)]:
            specfork.removeHandler(h)
