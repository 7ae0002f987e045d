"""How many threads specfork computes with (`--threads`, `load_model(threads=...)`).

`auto` (the default) is the cores this process may use: its CPU affinity, a cgroup CPU quota
(a container's `--cpus`), one thread per physical core; or `OMP_NUM_THREADS` where it is set
(the variable PyTorch and OpenMP programs follow). On specfork's kernels an `auto` count is
a ceiling: the kernels' thread pool (kernels/csrc/pool.h) watches how long its threads wait for
a core and runs fewer while other jobs keep the cores busy, and all of them again once the
cores are free. A number is that many threads, always (benchmarks that must not adapt).

The setting is the process's: PyTorch's intra-op threads and the kernels' pool are both
process-wide, so the last model loaded with a `threads` value sets it for every model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from specfork.checks import is_int
from specfork.errors import ConfigError

AUTO = "auto"
#: A measured window was busy when the threads waited for a core more than this share of it
#: (kernels/csrc/pool.cpp, Backoff::kBusy).
BUSY_WAIT = 0.15


@dataclass(frozen=True)
class Threads:
    """A thread setting: at most `count` threads; `adaptive`: fewer while the cores are busy."""

    count: int
    adaptive: bool

    def __post_init__(self) -> None:
        if not is_int(self.count) or self.count < 1:
            raise ConfigError(f"a thread count is a whole number >= 1, got {self.count!r}")

    def describe(self) -> str:
        plural = "thread" if self.count == 1 else "threads"
        return f"{self.count} {plural}" + (" (auto)" if self.adaptive else "")


def parse_threads(value: object) -> Threads:
    """`--threads`/`threads=` as a setting: None or "auto" → `auto_count()`, adaptive; a whole
    number >= 1 (int or digits) → exactly that many. ConfigError names anything else."""
    if value is None or value == AUTO:
        return Threads(auto_count(), adaptive=True)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not is_int(value) or value < 1:
        raise ConfigError(
            f"threads must be a whole number >= 1 or 'auto', got {value!r}; 'auto' (the default) "
            f"runs {auto_count()} here, fewer while other jobs keep the cores busy"
        )
    return Threads(value, adaptive=False)


def auto_count() -> int:
    """The most threads `auto` runs: OMP_NUM_THREADS when it is a whole number >= 1, else the
    usable cores."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(given) if given.isdigit() and int(given) >= 1 else usable_cores()


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may compute on: its CPU affinity, at most one thread per physical
    core, at most a cgroup CPU quota (under `cgroup`) rounded up, at least 1."""
    cpus = _affinity()
    count = min(len(cpus), _physical_cores(cpus) or len(cpus))
    quota = _cgroup_quota(cgroup)
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def apply_torch(threads: Threads) -> None:
    """PyTorch's intra-op threads (its eager operators) to the setting's count."""
    if torch.get_num_threads() != threads.count:
        torch.set_num_threads(threads.count)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """PyTorch's intra-op threads set to `count` inside the block (work that is mostly PyTorch's
    own operators, in a process that runs on specfork's kernels: training, a transformers
    baseline), put back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _physical_cores(cpus: list[int]) -> int | None:
    """Distinct (package, core) pairs among `cpus` (Linux sysfs); None where unknown."""
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            return None
        cores.add((package, core))
    return len(cores) or None


def _cgroup_quota(root: Path) -> float | None:
    """CPUs a cgroup quota allows this process (cgroup v2 cpu.max, v1 cfs_quota), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


@dataclass(frozen=True)
class ThreadUse:
    """The kernels' thread pool counters at one moment (kernels/csrc/pool.h PoolCounts):
    parallel regions run and those run on fewer threads than the most; ~50 ms windows measured
    and those in which the threads waited for a core more than BUSY_WAIT of the time."""

    threads: int
    adaptive: bool = False
    regions: int = 0
    reduced: int = 0
    windows: int = 0
    busy: int = 0

    def since(self, start: ThreadUse) -> ThreadReport:
        """What happened between `start` and this moment."""
        regions, windows = self.regions - start.regions, self.windows - start.windows
        return ThreadReport(
            threads=self.threads,
            adaptive=self.adaptive,
            reduced=(self.reduced - start.reduced) / regions if regions > 0 else 0.0,
            busy=(self.busy - start.busy) / windows if windows > 0 else 0.0,
        )


@dataclass(frozen=True)
class ThreadReport:
    """A run's threads: the most, the share of its parallel work run on fewer (the cores were
    busy), and the share of its measured time in which other jobs kept the cores busy."""

    threads: int
    adaptive: bool = False
    reduced: float = 0.0
    busy: float = 0.0

    #: reported when the cores were busy this share of a run (or work ran on fewer threads)
    NOTABLE = 0.1

    @property
    def shared(self) -> bool:
        """Whether other jobs shared the cores for a notable part of the run."""
        return self.busy >= self.NOTABLE or self.reduced >= self.NOTABLE

    def describe(self) -> str:
        """'2 threads', or '2 threads (fewer for 97%: cores busy)'."""
        plural = "thread" if self.threads == 1 else "threads"
        text = f"{self.threads} {plural}"
        if self.reduced >= self.NOTABLE:
            return f"{text} (fewer for {self.reduced:.0%}: cores busy)"
        if self.busy >= self.NOTABLE:
            return f"{text} (cores busy {self.busy:.0%} of the time)"
        return text

    def warning(self, subject: str = "this run") -> str | None:
        """One line for a run that shared its cores with other jobs, else None."""
        if not self.shared:
            return None
        if self.reduced >= self.NOTABLE:
            what = f"ran {self.reduced:.0%} of its work on fewer threads"
        else:
            what = f"waited for a core in {self.busy:.0%} of its time"
        advice = ""
        if not self.adaptive and self.threads > 1:
            advice = "; --threads auto (the default) runs fewer threads while the cores are busy"
        return (
            f"other jobs kept the cores busy: {subject} {what}, so its speed is not this "
            f"machine's idle speed{advice}"
        )
