"""What a Generator learns across requests to price and trim drafts: the acceptance rates a
strategy's gates hand on (strategies.rate_memory) and the cost curve corrected by observed
forwards (models.cost_calibration). Synthetic observations, no timings."""

from __future__ import annotations

import threading

import pytest
import torch

from specfork.config import GenerationConfig, SpecConfig
from specfork.drafters.base import Draft
from specfork.engine.generator import Generator
from specfork.errors import ConfigError
from specfork.loading.loader import LoadedModel, load_model
from specfork.models.cost import CostCurve
from specfork.models.cost_calibration import BAND, MIN_SEEN, REBUILD_EVERY, CostCalibration
from specfork.strategies.goodput import PRIOR, GoodputGate, TreeGate, new_gate
from specfork.strategies.rate_memory import RateBook, RateMemory
from specfork.tree import Tree
from specfork.verify import Verdict
from tiny_models import tiny_chat_llama

pytestmark = pytest.mark.usefixtures("one_thread")

CURVE = CostCurve((1, 2, 4, 8), (1.0, 1.1, 1.3, 1.7))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = tiny_chat_llama(tmp_path_factory.mktemp("tiny"), chat=False, seed=5)
    return load_model(str(folder), dtype="float32", kernels=False, progress=False)


# ------------------------------------------------------------------------ rate memory


def test_a_memory_seeds_at_most_its_weight_with_the_rate_kept() -> None:
    memory = RateMemory(cap=64, seed_weight=8)
    for i in range(40):
        memory.add(("chain", "ngram-3", 0), hit=i % 4 == 0)
    hits, trials = memory.seed()[("chain", "ngram-3", 0)]
    assert trials == pytest.approx(8) and hits / trials == pytest.approx(0.25)


def test_a_memory_halves_its_counts_past_the_cap_and_follows_a_change() -> None:
    memory = RateMemory(cap=16, seed_weight=100)
    for _ in range(16):
        memory.add("k", hit=True)
    for _ in range(40):  # the workload changes: nothing is accepted any more
        memory.add("k", hit=False)
    hits, trials = memory.snapshot()["k"]
    assert trials <= 16 and hits / trials < 0.05


def test_a_memory_snapshot_restores_exactly_and_is_thread_safe() -> None:
    memory = RateMemory()
    memory.add("a", hit=True)
    before = memory.snapshot()

    def add_many() -> None:
        for _ in range(500):
            memory.add("b", hit=False)

    threads = [threading.Thread(target=add_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert memory.snapshot()["b"][1] <= memory.cap  # never grew past its bound
    memory.restore(before)
    assert memory.snapshot() == before


def test_a_book_keeps_one_memory_per_strategy_within_its_bound() -> None:
    book = RateBook(max_strategies=2)
    a, b = book.memory("a"), book.memory("b")
    assert book.memory("a") is a and a is not b
    book.memory("c")  # b was used least recently: dropped
    assert book.memory("a") is a and book.memory("b") is not b
    assert RateBook(shared=False).memory("a") is None
    with pytest.raises(ValueError, match="max_strategies"):
        RateBook(max_strategies=0)


def test_a_chain_gate_starts_from_what_earlier_requests_learned() -> None:
    memory = RateMemory()
    first = GoodputGate(CURVE, memory)
    assert first.stats.rates("ngram-3", 1) == [PRIOR]
    for _ in range(30):  # ngram-3's first token is never accepted
        first.observe("ngram-3", [5, 6], [9])
    later = GoodputGate(CURVE, memory)
    assert later.stats.rates("ngram-3", 1)[0] < 0.15
    assert later.length("ngram-3", 2) == 0  # it no longer drafts from the first round on
    alone = GoodputGate(CURVE)
    assert alone.length("ngram-3", 2) > 0  # a gate without memory starts from the prior


def test_a_tree_gate_that_kept_nothing_says_no_tree_pays() -> None:
    memory = RateMemory()
    gate = new_gate(True, CostCurve((1, 2, 3), (1.0, 1.4, 1.8)), memory)
    assert isinstance(gate, TreeGate) and gate.first_rate() == PRIOR
    tree = Tree(torch.tensor([10, 11]), torch.tensor([-1, -1]))  # two first-level forks
    draft = Draft(tree, scores=torch.tensor([1.0, 0.5], dtype=torch.float64), source="forks")
    for _ in range(20):  # neither fork is ever accepted
        gate.learn(draft, draft, Verdict([], [7]), costly=False)
    assert len(gate.trim(draft, costly=False)) == 0
    assert gate.first_rate() == 0.0  # the scheduler then skips drafting
    fresh = TreeGate(CostCurve((1, 2, 3), (1.0, 1.4, 1.8)), memory)  # the next request
    assert len(fresh.trim(draft, costly=False)) == 0 and fresh.first_rate() < 0.2


# ------------------------------------------------------------------------ calibration


def test_calibration_prices_rows_as_observed() -> None:
    calibration = CostCalibration(CURVE)
    assert calibration.at(300)(4) == CURVE(4)  # nothing observed: the measured curve
    for _ in range(MIN_SEEN):  # 4 rows take 1.6 one-row steps where the curve says 1.3
        calibration.observe(1, 300, 0.010)
        calibration.observe(4, 300, 0.016)
    calibration.observe(4, 300, 1.0)  # a slow spell of the machine: the median ignores it
    for _ in range(REBUILD_EVERY):
        calibration.observe(1, 300, 0.010)
    curve = calibration.at(300)
    assert curve(1) == 1.0 and curve(4) == pytest.approx(1.6)
    assert curve(8) == pytest.approx(1.0 + 0.7 * 2)  # unseen: the curve's extra cost × (0.6/0.3)
    far = calibration.at(5 * BAND)  # no one-row forward there: band 0's correction
    assert far(4) == pytest.approx(1.6)


def test_calibration_waits_for_one_row_forwards_and_ignores_bad_input() -> None:
    calibration = CostCalibration(CURVE)
    for _ in range(20):
        calibration.observe(4, 300, 0.05)  # no one-row forward yet: nothing to compare with
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        calibration.observe(1, 300, bad)
    calibration.observe(0, 300, 0.01)
    assert calibration.at(300)(4) == CURVE(4)
    for _ in range(3 * REBUILD_EVERY):  # more rows never cost less, one row costs one
        calibration.observe(1, 300, 0.010)
        calibration.observe(2, 300, 0.030)
        calibration.observe(3, 300, 0.020)
    curve = calibration.at(300)
    assert curve(1) == 1.0 and curve(2) == pytest.approx(3.0) and curve(3) >= curve(2)


def test_a_generator_prices_by_the_calibration_unless_given_a_curve(tiny: LoadedModel) -> None:
    spec = SpecConfig("speculative", "ngram", k=3)
    own = Generator(tiny, spec=spec)
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    own.generate([1, 2, 3, 4], config=config)
    assert isinstance(own.pricing(), CostCalibration)
    assert own.pricing().curve is own.cost_curve()
    given = Generator(tiny, spec=spec, cost_curve=CURVE)
    assert given.pricing() is CURVE


def test_requests_of_a_strategy_share_rates_and_another_strategy_does_not(
    tiny: LoadedModel,
) -> None:
    gen = Generator(tiny, spec=SpecConfig("speculative", "ngram", k=3))
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    gen.generate([5, 6, 7, 5, 6, 7, 5, 6], config=config)
    learned = gen.rates.memory(gen.spec).snapshot()
    assert learned and all(k[0] == "chain" for k in learned)
    assert gen.rates.memory(SpecConfig("dspark", "ngram")).snapshot() == {}
    with pytest.raises(ConfigError, match="rates must be a RateBook"):
        Generator(tiny, rates={})  # type: ignore[arg-type]
