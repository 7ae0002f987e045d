"""The host work of verifying a draft, priced for the goodput gates (engine.overhead): synthetic
round times for the tracker and the gates (no timings measured), and the scheduler's wiring on
a tiny model (it changes which rounds draft, never the output)."""

from __future__ import annotations

import pytest

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.generator import Generator
from specfork.engine.overhead import MIN_ROUNDS, VerifyOverhead, host_seconds
from specfork.loading.loader import LoadedModel, load_model
from specfork.models.cost import CostCurve
from specfork.strategies.goodput import GoodputGate, TreeGate, best_length
from tiny_models import tiny_chat_llama

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
CONFIG = GenerationConfig(max_new_tokens=24, ignore_eos=True)
LONG = CostCurve((1, 2, 4, 8), (1.0, 1.17, 1.5, 2.7))  # rows at a 4k-token context


def flat(tokens: int) -> float:
    return 1.0


def filled(verified_host: float, plain_host: float, forward: float, step_at=flat) -> VerifyOverhead:
    tracker = VerifyOverhead(step_at)
    for _ in range(MIN_ROUNDS):
        tracker.add(True, verified_host, 0.002, 100)
        tracker.add(False, plain_host, forward, 100)
    return tracker


def test_no_price_until_both_kinds_of_round_were_seen() -> None:
    tracker = VerifyOverhead(flat)
    for _ in range(MIN_ROUNDS - 1):
        tracker.add(True, 0.001, 0.002, 100)
        tracker.add(False, 0.0002, 0.002, 100)
    assert tracker.price(100) == 0.0
    tracker.add(True, 0.001, 0.002, 100)
    assert tracker.price(100) == 0.0  # still one plain round short
    tracker.add(False, 0.0002, 0.002, 100)
    assert tracker.price(100) == pytest.approx(0.4)  # (1.0 - 0.2) ms over a 2 ms forward


def test_the_price_is_in_one_row_forwards_at_the_requests_context() -> None:
    def grows(tokens: int) -> float:  # a one-row forward twice as long at 4k tokens
        return 1.0 + tokens / 4000

    tracker = filled(0.0005, 0.0001, 0.002, step_at=grows)
    at_short = tracker.price(0)
    assert at_short == pytest.approx(0.0004 / (0.002 / grows(100)))
    assert tracker.price(4000) == pytest.approx(at_short / 2)


def test_rounds_that_verify_no_slower_than_plain_ones_cost_nothing() -> None:
    assert filled(0.0001, 0.0003, 0.002).price(100) == 0.0


def test_host_seconds_count_the_phases_after_drafting() -> None:
    before = {"draft": 1.0, "accept": 2.0, "forward": 5.0}
    after = {"draft": 3.0, "accept": 2.5, "commit": 0.25, "learn": 0.125, "forward": 9.0}
    assert host_seconds(before, after) == pytest.approx(0.875)


def test_a_draft_that_barely_pays_by_the_curve_is_not_verified_once_its_host_work_counts() -> None:
    rates = [0.19]  # one sampled token at a 4k-token context: 1.19 tokens for c(2) = 1.17
    assert best_length(rates, LONG) == 1
    assert best_length(rates, LONG, overhead=0.05) == 0
    assert best_length([0.9, 0.9, 0.9], LONG, overhead=0.05) == 3  # a draft that pays still does


def test_the_chain_gate_and_the_tree_gate_charge_the_overhead() -> None:
    chain = GoodputGate(LONG)
    chain.stats.observe("ngram", [1, 2], [1, 9])  # position 1 accepted, 2 not
    chain.at_context(4000)
    kept = chain.length("ngram", 1)
    chain.at_context(4000, overhead=1.0)
    assert kept == 1 and chain.length("ngram", 1) == 0
    tree = TreeGate(LONG)
    scores, parents = [0.6, 0.3], [-1, 0]
    tree.at_context(4000)
    assert any(tree.keep(scores, parents))
    tree.at_context(4000, overhead=1.0)
    assert not any(tree.keep(scores, parents))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = tiny_chat_llama(tmp_path_factory.mktemp("tiny"), chat=False, seed=3)
    return load_model(str(folder), dtype="float32", kernels=False, progress=False)


def test_lone_rounds_feed_the_tracker_and_the_output_is_plain_decodings(
    tiny: LoadedModel,
) -> None:
    spec = SpecConfig("speculative", "ngram", k=3)
    gen = Generator(tiny, spec=spec)
    plain = gen.generate(PROMPT, config=CONFIG, spec=SpecConfig()).token_ids
    for _ in range(3):
        assert gen.generate(PROMPT, config=CONFIG).token_ids == plain
    tracker = gen.verify_overhead(spec)
    assert tracker is not None
    assert len(tracker._verified) > 0 and len(tracker._plain) > 0
    assert tracker.price(100) >= 0.0
    given = Generator(tiny, spec=spec, cost_curve=CostCurve((1, 2), (1.0, 1.1)))
    given.generate(PROMPT, config=CONFIG)
    assert given.verify_overhead(spec) is None  # draft lengths stay reproducible
