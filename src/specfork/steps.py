"""Long one-time steps (compiling the kernels, computing a recycle prior) told through logging.

A step that makes the user wait logs its start and its end as WARNING records that carry
`extra={"long_step": "start" | "end" | "failed", "step": what}`: the library stays silent beyond
its log, and a front end (the CLI on a terminal) turns the pair into a spinner with the elapsed
time instead of two log lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

START, END, FAILED = "start", "end", "failed"


@contextmanager
def long_step(log: logging.Logger, what: str, expected: str) -> Iterator[None]:
    """Log `what` (with how long it usually takes: `expected`) before the block, and its time
    after it; a block that raises logs that it failed, then the error goes on."""
    t0 = time.perf_counter()
    log.warning("%s (%s)…", what, expected, extra={"long_step": START, "step": what})
    try:
        yield
    except BaseException:
        log.warning("%s failed", what, extra={"long_step": FAILED, "step": what})
        raise
    seconds = time.perf_counter() - t0
    log.warning("%s: done in %.0f s", what, seconds, extra={"long_step": END, "step": what})
