"""Thread settings (specfork.threads) and the kernels' own thread pool (kernels/csrc/pool.h).

The pool's speed under shared cores is measured by benchmarks/shared_cores.py (timings do not
belong in tests); here: the setting's parsing and defaults, the cgroup quota, the reports, the
back-off rule on given run-delay shares, and that results are bitwise the same whatever the
thread count, with two callers at once, and in a forked child.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.generator import Generator
from specfork.errors import ConfigError
from specfork.kernels import load_kernels
from specfork.kernels.pack import Kind, pack_float
from specfork.loading.loader import LoadedModel, load_model
from specfork.threads import (
    ThreadReport,
    Threads,
    ThreadUse,
    _cgroup_quota,
    auto_count,
    parse_threads,
    usable_cores,
)
from tiny_models import tiny_chat_llama

K = load_kernels()
needs_kernels = pytest.mark.skipif(K is None, reason="the kernels cannot be built here")


# -- the setting --------------------------------------------------------------------------------
def test_auto_is_adaptive_and_a_number_is_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert parse_threads(None) == Threads(usable_cores(), adaptive=True)
    assert parse_threads("auto") == parse_threads(None)
    assert parse_threads(3) == Threads(3, adaptive=False)
    assert parse_threads(" 2 ") == Threads(2, adaptive=False)


def test_auto_follows_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert parse_threads("auto") == Threads(5, adaptive=True)
    monkeypatch.setenv("OMP_NUM_THREADS", "zero")  # not a count: the usable cores
    assert auto_count() == usable_cores()


@pytest.mark.parametrize("bad", [0, -1, "x", "1.5", 1.5, True, "", [2]])
def test_a_bad_thread_count_is_named(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"threads must be a whole number >= 1 or 'auto', got"):
        parse_threads(bad)


def test_usable_cores_is_at_least_one_and_at_most_the_affinity() -> None:
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "200000", "cpu/cpu.cfs_period_us": "100000"}, 2.0),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ({"cpu.max": "garbage"}, None),
        ({}, None),
    ],
)
def test_the_cgroup_quota_is_read(
    tmp_path: Path, files: dict[str, str], quota: float | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _cgroup_quota(tmp_path) == quota


def test_a_quota_caps_the_usable_cores(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("50000 100000")  # half a CPU: one thread
    assert usable_cores(tmp_path) == 1


# -- reports ------------------------------------------------------------------------------------
def test_a_quiet_run_reports_its_count_alone() -> None:
    start = ThreadUse(2, True, regions=100, reduced=0, windows=10, busy=0)
    report = ThreadUse(2, True, regions=600, reduced=0, windows=30, busy=1).since(start)
    assert report == ThreadReport(2, True, reduced=0.0, busy=0.05)
    assert report.describe() == "2 threads"
    assert report.warning() is None
    assert ThreadReport(1).describe() == "1 thread"


def test_a_run_on_busy_cores_says_so() -> None:
    backed_off = ThreadUse(2, True, regions=1000, reduced=900, windows=40, busy=8).since(
        ThreadUse(2, True)
    )
    assert backed_off.describe() == "2 threads (fewer for 90%: cores busy)"
    assert "ran 90% of its work on fewer threads" in backed_off.warning()
    assert "--threads auto" not in backed_off.warning()
    fixed = ThreadReport(2, adaptive=False, reduced=0.0, busy=0.5)
    assert fixed.describe() == "2 threads (cores busy 50% of the time)"
    assert "waited for a core in 50% of its time" in fixed.warning("a request")
    assert fixed.warning("a request").startswith("other jobs kept the cores busy: a request")
    assert "--threads auto (the default)" in fixed.warning()


# -- the pool -----------------------------------------------------------------------------------
@needs_kernels
def test_the_back_off_rule() -> None:
    # busy at 2 threads: 1; quiet windows before the 0.2 s pause: stay; after it: try 2 again
    assert K.backoff_trace(2, [0.5, 0.0, 0.0], 0.025) == [1, 1, 1]
    assert K.backoff_trace(2, [0.5] + [0.0] * 41, 0.025)[-1] == 2
    # the try comes in window 8 (0.2 s after the busy one); when the window after it is busy
    # too, the pause doubles: the next try comes 0.4 s later (window 25), not 0.2 s
    failed = [0.5] + [0.0] * 8 + [0.5]
    trace = K.backoff_trace(2, failed + [0.0] * 10, 0.025)
    assert [i for i in range(1, len(trace)) if trace[i] > trace[i - 1]] == [8]
    assert K.backoff_trace(2, failed + [0.0] * 17, 0.025)[-1] == 2
    # a busy machine is not tried while the one thread itself waits for a core
    assert K.backoff_trace(2, [0.5] + [0.3] * 100, 0.025)[-1] == 1
    # many threads back off in proportion to the wait, and never below one
    assert K.backoff_trace(16, [0.5], 0.025) == [8]
    assert K.backoff_trace(4, [0.99, 0.99], 0.025) == [1, 1]
    # a quiet pool keeps its threads; a little waiting is not busy
    assert K.backoff_trace(2, [0.0, 0.1, 0.14], 0.025) == [2, 2, 2]


def _weight(n: int = 512, k: int = 256) -> object:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.1
    return K.Packed(int(Kind.BF16), n, k, pack_float(w, Kind.BF16))


@pytest.fixture
def pool_settings():
    """Tests that change the pool put back what the process had."""
    before = (K.threads(), torch.get_num_threads())
    yield
    K.set_threads(before[0], False)
    torch.set_num_threads(before[1])


@needs_kernels
@pytest.mark.usefixtures("pool_settings")
def test_every_thread_count_gives_the_same_bits() -> None:
    w, x = _weight(), torch.randn(40, 256, generator=torch.Generator().manual_seed(1))
    K.set_threads(1, False)
    one = K.packed_linear(w, x)
    for threads, adaptive in ((2, False), (3, False), (4, True), (2, True)):
        K.set_threads(threads, adaptive)
        assert K.threads() == threads
        assert torch.equal(K.packed_linear(w, x), one), threads


@needs_kernels
@pytest.mark.usefixtures("pool_settings")
def test_two_callers_at_once_get_their_own_results() -> None:
    """A second thread calling the kernels while the pool is busy runs its region alone."""
    K.set_threads(2, False)
    w = _weight()
    xs = [torch.randn(8, 256, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    expected = [K.packed_linear(w, x) for x in xs]
    failures: list[int] = []

    def work(i: int) -> None:
        for _ in range(200):
            if not torch.equal(K.packed_linear(w, xs[i]), expected[i]):
                failures.append(i)

    callers = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert failures == []


@needs_kernels
@pytest.mark.usefixtures("pool_settings")
def test_a_forked_child_computes_with_a_fresh_pool() -> None:
    """The parent's workers do not exist in a child: it must not wait for them."""
    K.set_threads(2, False)
    w, x = _weight(), torch.randn(16, 256, generator=torch.Generator().manual_seed(2))
    expected = K.packed_linear(w, x)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, report, leave at once
        ok = torch.equal(K.packed_linear(w, x), expected) and K.threads() >= 1
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        answer = f.read()
    os.waitpid(pid, 0)
    assert answer == b"1"


# -- end to end ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(tiny_chat_llama(tmp_path_factory.mktemp("tiny-threads"))), progress=False)


@pytest.mark.usefixtures("pool_settings")
def test_load_model_sets_the_threads_and_results_report_them(tmp_path: Path) -> None:
    loaded = load_model(str(tiny_chat_llama(tmp_path / "m")), threads=1, progress=False)
    assert torch.get_num_threads() == 1
    result = Generator(loaded).generate("hi", config=GenerationConfig(max_new_tokens=3))
    assert result.stats.threads is not None and result.stats.threads.threads == 1
    assert "1 thread" in result.stats.summary()
    assert result.stats.to_dict()["threads"]["threads"] == 1
    with pytest.raises(ConfigError, match="threads must be"):
        load_model(str(tmp_path / "m"), threads="many", progress=False)


@pytest.mark.usefixtures("pool_settings")
def test_outputs_do_not_depend_on_the_thread_setting(tiny: LoadedModel) -> None:
    gen = Generator(tiny, spec=SpecConfig("spork", "recycle+ngram"))
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    outputs = []
    for setting in ("1", "2", "3", "auto"):
        tiny.model.set_threads(parse_threads(setting))
        outputs.append(gen.generate("Count: 1 2 3 1 2 3 1 2", config=config).token_ids)
    assert all(o == outputs[0] for o in outputs)
