"""Run a model from the thread that created PyTorch's CPU thread pool.

PyTorch's CPU kernels run on OpenMP. GNU OpenMP gives every thread that starts parallel work a
pool of worker threads of its own; once a second pool exists (the model loaded in one thread and
run in another), libgomp counts more threads than cores and stops spinning between parallel
regions, so each of the several hundred parallel operations of a decoding step waits for a
sleeping worker to wake up. Measured on two cores: decoding from a second thread ran at 0.5-0.7x
the speed of decoding from the thread that loaded the model, and a 64x64 matmul took 72 us
instead of 5 us (benchmarks/serve_load.py reports the server's speed against the library's).

So a program that decodes in a background thread (the server does) loads, warms and runs the
model in that one thread: `model_thread()` is that thread, `run_in(thread, fn, ...)` a call on
it. A thread that never ran parallel work (the main thread of `specfork serve`) creates no pool.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

THREAD_NAME = "specfork-engine"


def model_thread() -> ThreadPoolExecutor:
    """A single-thread executor: everything submitted to it runs on one and the same thread."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)


def run_in(thread: Executor, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Call `fn` on `thread` and wait for its result (its exception is raised here)."""
    return thread.submit(fn, *args, **kwargs).result()
