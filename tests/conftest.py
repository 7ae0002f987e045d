"""Shared fixtures: the default packaged model, loaded once per test session.

The model is fetched into the usual specfork cache (``$SPECFORK_CACHE_DIR`` or
``~/.cache/specfork``) on first use, like the CLI does. It is loaded in float32 on the CPU so that
results are exact and comparable with transformers' reference on every machine.
"""

from __future__ import annotations

import os

import pytest
import torch

from specfork.host import cache_dir
from specfork.loading.loader import LoadedModel, load_model
from specfork.loading.registry import DEFAULT_MODEL
from specfork.loading.weight_cache import source_of


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per core, at most 4 (every worker loads its own copies of the
    models, so the cap bounds memory on large machines; only 2 workers were measured)."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None  # Linux
    return max(1, min(4, len(usable) if usable else os.cpu_count() or 1))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist every worker gets its share of the intra-op threads: N workers each
    running all of them would oversubscribe the cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, torch.get_num_threads() // workers)
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)  # what threads="auto" runs (specfork.threads)


@pytest.fixture(scope="session", autouse=True)
def _converted_test_models_leave_the_cache(tmp_path_factory: pytest.TempPathFactory):
    """Tests load tiny models written to temporary folders, and loading converts them into the
    cache folder's `weights/` like any model: those conversions (float32 copies, kernel packs)
    are removed when the session ends, so the suite leaves the user's cache as it found it."""
    yield
    base = str(tmp_path_factory.getbasetemp().resolve()) + os.sep
    for path in (cache_dir() / "weights").glob("*.safetensors"):
        if (source_of(path) or "").startswith(base):
            path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def smollm_f32() -> LoadedModel:
    """SmolLM2-135M-Instruct (the default model), float32, CPU."""
    return load_model(DEFAULT_MODEL, dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add synchronization (seconds per test when the CPUs
    are shared), so such tests run single-threaded and restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
