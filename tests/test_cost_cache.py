"""The cost curve kept on disk between processes (`specfork.models.cost_cache`), on a tiny
random model: stored at first use, read back instead of measured, measured again when the
file is stale, unreadable or another curve, and keyed by the weights and the thread count."""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.generator import Generator
from specfork.loading.loader import LoadedModel, load_model
from specfork.models import cost_cache
from specfork.models.cost import ROWS, CostCurve, lower_hull
from specfork.threads import Threads, ThreadUse
from tiny_models import tiny_chat_llama

pytestmark = pytest.mark.usefixtures("one_thread")

EDITED = [1.0 + 0.25 * (r - 1) for r in ROWS]  # a valid curve no measurement gives (convex)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = tiny_chat_llama(tmp_path_factory.mktemp("tiny"), chat=False, seed=5)
    return load_model(str(folder), dtype="float32", kernels=False, progress=False)


def _edit(path: Path) -> None:
    path.write_text(json.dumps({"rows": list(ROWS), "cost": EDITED}))


def test_the_far_curve_is_stored_and_read_back(tmp_path) -> None:
    near, far = tuple(1.0 + 0.1 * (r - 1) for r in ROWS), EDITED
    curve = CostCurve(ROWS, near, 192, CostCurve(ROWS, tuple(far), 1024), 1.7)
    path = tmp_path / "curve.json"
    cost_cache.write_curve(curve, path)
    assert cost_cache.read_curve(path) == curve
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "far_context": 100}))  # not beyond the near context
    assert cost_cache.read_curve(path) is None


STALE = (1.0, 1.0, 1.54, 1.54, 1.54, 1.61, 2.30, 2.66, 4.03, 5.46)  # a slow spell at 3-6 rows


def test_a_cost_above_the_curves_lower_hull_is_lowered_to_it() -> None:
    smooth = lower_hull(ROWS, STALE)
    on_line = tuple(1.0 + (1.61 - 1.0) * (r - 2) / 6 for r in (3, 4, 6))  # from 2 to 8 rows
    assert smooth[2:5] == pytest.approx(on_line)
    assert smooth[6] == pytest.approx(1.61 + (2.66 - 1.61) / 2)  # 12 rows: between 8 and 16
    kept = (0, 1, 5, 7, 8, 9)  # the hull's vertices keep their measured cost
    assert all(smooth[i] == STALE[i] for i in kept)
    assert all(a <= b for a, b in zip(smooth, STALE, strict=True))  # never raised
    assert all(a <= b for a, b in itertools.pairwise(smooth))  # still rising
    convex = tuple(1.0 + 0.02 * (r - 1) ** 1.5 for r in ROWS)
    assert lower_hull(ROWS, convex) == convex


def test_a_stored_curve_with_a_spike_is_read_back_lowered(tmp_path) -> None:
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"rows": list(ROWS), "cost": list(STALE), "context": 192}))
    curve = cost_cache.read_curve(path)
    assert curve is not None and curve.cost == lower_hull(ROWS, STALE)


def test_a_long_enough_model_gets_a_far_curve(tiny: LoadedModel) -> None:
    curve = CostCurve.measure(tiny.model, repeats=1, context=16, far_context=128)
    assert curve.context == 16 and curve.far is not None and curve.far.context == 128
    assert curve.far_step > 0 and curve.at(128).cost == pytest.approx(curve.far.cost)
    short = CostCurve.measure(tiny.model, repeats=1, context=16, far_context=10**6)
    assert short.far is None  # beyond the model's positions: no far measurement


def test_a_stored_curve_is_read_back_instead_of_measured(tiny: LoadedModel, tmp_path) -> None:
    first = cost_cache.load_or_measure(tiny.model, tiny.path, tmp_path)
    (path,) = tmp_path.iterdir()
    assert path == cost_cache.curve_file(tiny.model, tiny.path, tmp_path)
    assert json.loads(path.read_text())["cost"] == list(first.cost)
    _edit(path)
    assert list(cost_cache.load_or_measure(tiny.model, tiny.path, tmp_path).cost) == EDITED


@pytest.mark.parametrize("damage", ["stale", "corrupt", "another-curve"])
def test_a_bad_or_stale_file_is_measured_again(
    tiny: LoadedModel, tmp_path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = cost_cache.curve_file(tiny.model, tiny.path, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if damage == "stale":
        _edit(path)
        old = time.time() - (cost_cache.MAX_AGE_DAYS + 1) * 86400
        os.utime(path, (old, old))
    elif damage == "corrupt":
        path.write_text('{"rows": [1, 2')
    else:
        path.write_text(json.dumps({"rows": [1, 2], "cost": [1.0, 0.5]}))
    with caplog.at_level(logging.WARNING, logger="specfork.models.cost_cache"):
        curve = cost_cache.load_or_measure(tiny.model, tiny.path, tmp_path)
    assert list(curve.cost) != EDITED and curve.rows == ROWS
    assert json.loads(path.read_text())["cost"] == list(curve.cost)  # stored afresh
    assert bool(caplog.records) == (damage != "stale")  # a stale file is no fault


def test_the_key_follows_the_weights_and_the_thread_count(tiny: LoadedModel, tmp_path) -> None:
    before = cost_cache.curve_file(tiny.model, tiny.path, tmp_path)
    threads = tiny.model.thread_use().threads
    tiny.model.set_threads(Threads(threads + 1, adaptive=False))
    try:
        assert cost_cache.curve_file(tiny.model, tiny.path, tmp_path) != before
    finally:
        tiny.model.set_threads(Threads(threads, adaptive=False))
    os.utime(tiny.path, (time.time() + 5, time.time() + 5))  # the weights changed
    assert cost_cache.curve_file(tiny.model, tiny.path, tmp_path) != before


@dataclass
class _OnKernels:
    """What `curve_file` reads of a model on the kernels, with the kernels' module given."""

    kernels: object
    dtype: torch.dtype = torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def describe(self) -> str:
        return "gguf, cpu, kernels avx2"

    def thread_use(self) -> ThreadUse:
        return ThreadUse(threads=2)


def test_the_key_follows_the_kernels_build(tiny: LoadedModel, tmp_path) -> None:
    """New kernels (another build, its module named by its sources' digest) measure afresh."""
    one = cost_cache.curve_file(
        _OnKernels(ModuleType("specfork_kernels_aaaa")), tiny.path, tmp_path
    )
    two = cost_cache.curve_file(
        _OnKernels(ModuleType("specfork_kernels_bbbb")), tiny.path, tmp_path
    )
    assert one != two
    assert one == cost_cache.curve_file(
        _OnKernels(ModuleType("specfork_kernels_aaaa")), tiny.path, tmp_path
    )


def test_a_generator_stores_the_curve_a_later_process_reads(
    tiny: LoadedModel, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gated request stores the model's curve in the cache folder; a model loaded again (as
    by a new process) reads it, and a curve given to the constructor still wins."""
    monkeypatch.setenv("SPECFORK_CACHE_DIR", str(tmp_path))
    spec = SpecConfig("speculative", "ngram", k=2)  # the goodput gate on: it needs the curve
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    Generator(tiny, spec=spec).generate("abc abc abc", config=config)
    (path,) = (tmp_path / "cost").iterdir()
    _edit(path)
    again = load_model(str(tiny.path), dtype="float32", kernels=False, progress=False)
    gen = Generator(again, spec=spec)
    gen.generate("abc abc abc", config=config)
    assert list(gen.cost_curve().cost) == EDITED
    given = Generator(again, spec=spec, cost_curve=tiny.model.cost_curve())
    assert given.cost_curve() is tiny.model.cost_curve()
