"""Payback: a lone request stops drafting while its drafting rounds emit fewer tokens per second
than plain rounds (engine.payback). Synthetic round times (no timings measured), and the
scheduler's wiring on a tiny model: pauses change which rounds draft, never the output."""

from __future__ import annotations

import pytest

from specfork.bench.specs import parse_strategy
from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.batch import Scheduler
from specfork.engine.generator import Generator
from specfork.engine.payback import (
    FRESH_SECONDS,
    MAX_PAUSE,
    PAUSE,
    WINDOW,
    Payback,
    PlainClock,
)
from specfork.errors import ConfigError
from specfork.loading.loader import LoadedModel, load_model
from specfork.models.cost import CostCurve
from tiny_models import tiny_chat_llama

pytestmark = pytest.mark.usefixtures("one_thread")


class Clock:
    """Seconds that pass only when told."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def flat(tokens: int) -> float:
    return 1.0


def checked(plain_seconds: float = 0.010, step_at=flat, now=None) -> Payback:
    clock = PlainClock(step_at, now or Clock())
    payback = Payback(clock)
    for _ in range(4):
        payback.observe(False, 1, 100, plain_seconds)
    return payback


def rounds_until_it_drafts(payback: Payback) -> int:
    n = 0
    while not payback.allows(100):
        n += 1
    return n


def test_drafting_that_loses_to_plain_rounds_pauses_and_the_pause_doubles() -> None:
    payback = checked()
    for _ in range(WINDOW):  # 2 tokens in 30 ms: 67 tokens/s against plain rounds' 100
        assert payback.allows(100)
        payback.observe(True, 2, 100, 0.030)
    assert rounds_until_it_drafts(payback) == PAUSE
    for _ in range(WINDOW):
        payback.observe(True, 2, 100, 0.030)
    assert rounds_until_it_drafts(payback) == 2 * PAUSE and payback.pauses == 2
    for _ in range(20):  # still losing: the pause grows to its bound, no further
        for _ in range(WINDOW):
            payback.observe(True, 2, 100, 0.030)
        rounds_until_it_drafts(payback)
    assert payback.pause == MAX_PAUSE


def test_drafting_that_pays_never_pauses_and_a_paying_window_resets_the_pause() -> None:
    payback = checked()
    for _ in range(5 * WINDOW):  # 2 tokens in 15 ms: 133 tokens/s
        assert payback.allows(100)
        payback.observe(True, 2, 100, 0.015)
    assert payback.pauses == 0
    while payback.pauses == 0:  # a losing spell: 1 token in 30 ms
        payback.observe(True, 1, 100, 0.030)
    rounds_until_it_drafts(payback)
    assert payback.pause == 2 * PAUSE
    for _ in range(WINDOW):
        payback.observe(True, 3, 100, 0.015)
    assert payback.pause == PAUSE and payback.pauses == 1 and payback.allows(100)


def test_a_loss_within_the_margin_is_noise_not_a_reason_to_pause() -> None:
    payback = checked()
    for _ in range(3 * WINDOW):  # 2 tokens in 20.6 ms: 3% slower than plain rounds
        payback.observe(True, 2, 100, 0.0206)
    assert payback.pauses == 0 and payback.allows(100)


def test_without_a_fresh_plain_round_a_drafting_request_runs_one() -> None:
    now = Clock()
    clock = PlainClock(flat, now)
    payback = Payback(clock)
    for _ in range(WINDOW):
        assert payback.allows(100)
        payback.observe(True, 1, 100, 0.030)
    assert not payback.allows(100)  # no plain round to compare with: this round is one
    payback.observe(False, 1, 100, 0.010)
    assert clock.reference(100) == pytest.approx(0.010)
    payback.observe(True, 1, 100, 0.030)
    assert payback.pauses == 1  # judged at once, against the plain round
    now.t += FRESH_SECONDS + 1  # the machine may have changed speed since
    assert clock.reference(100) is None


def test_plain_rounds_near_the_requests_context_are_preferred() -> None:
    clock = PlainClock(flat, Clock())
    for _ in range(3):
        clock.add(0.010, 100)
        clock.add(0.020, 3000)
    assert clock.reference(200) == pytest.approx(0.010)
    assert clock.reference(3100) == pytest.approx(0.020)
    assert clock.reference(1500) == pytest.approx(0.015)  # none near: every fresh one


def test_rounds_are_compared_at_one_context_by_the_curves_one_row_growth() -> None:
    # a one-row step after 1,000 cached tokens takes twice what it takes after none; 3 tokens
    # in 36 ms there (12 ms each) beat plain rounds of 10 ms after 100 tokens
    payback = checked(0.010, step_at=lambda tokens: 1.0 + tokens / 1000)
    for _ in range(3 * WINDOW):
        payback.observe(True, 3, 1000, 0.036)
    assert payback.pauses == 0
    unscaled = checked(0.010)
    for _ in range(WINDOW):
        unscaled.observe(True, 3, 1000, 0.036)
    assert unscaled.pauses == 1


def test_rounds_that_emitted_nothing_or_took_no_time_are_not_counted() -> None:
    payback = checked()
    for bad in (0.0, -1.0, float("nan")):
        payback.observe(True, 2, 100, bad)
    payback.observe(True, 0, 100, 1.0)
    assert payback.pauses == 0 and len(payback._drafting) == 0


def test_the_curve_prices_one_row_by_context() -> None:
    near = CostCurve((1, 2), (1.0, 1.2), context=200)
    curve = CostCurve((1, 2), (1.0, 1.2), 200, CostCurve((1, 2), (1.0, 1.5), 1200), far_step=2.0)
    assert near.step_at(5000) == 1.0
    assert curve.step_at(100) == 1.0 and curve.step_at(700) == pytest.approx(1.5)
    assert curve.step_at(2200) == pytest.approx(3.0)  # extrapolated past the far measurement


# ------------------------------------------------------------------------ in the scheduler


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = tiny_chat_llama(tmp_path_factory.mktemp("tiny"), chat=False, seed=7)
    return load_model(str(folder), dtype="float32", kernels=False, progress=False)


PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
CONFIG = GenerationConfig(max_new_tokens=24, ignore_eos=True)


def test_a_paused_request_drafts_nothing_and_emits_plain_decodings_tokens(
    tiny: LoadedModel,
) -> None:
    gen = Generator(tiny, spec=SpecConfig("speculative", "ngram", k=3))
    plain = gen.generate(PROMPT, config=CONFIG, spec=SpecConfig()).token_ids
    drafted = gen.generate(PROMPT, config=CONFIG)  # measures the model's own cost curve
    clock = gen.plain_clock()
    assert clock is not None and drafted.token_ids == plain
    scheduler = Scheduler.alone(gen)
    running = scheduler.add(PROMPT, config=CONFIG)
    running.payback = Payback(clock, waiting=6)
    while not running.finished:
        scheduler.step()
    rounds = running.req.stats.rounds
    assert [r.drafted for r in rounds[:6]] == [0] * 6 and running.req.stats.paused_rounds >= 6
    assert running.req.out.token_ids == plain


def test_the_payback_option_turns_it_off(tiny: LoadedModel) -> None:
    spec = parse_strategy("speculative:ngram?k=3&payback=false").spec
    assert spec is not None and spec.payback is False
    gen = Generator(tiny, spec=spec)
    gen.generate(PROMPT, config=CONFIG)
    scheduler = Scheduler.alone(gen)
    running = scheduler.add(PROMPT, config=CONFIG)
    while not running.finished:
        scheduler.step()
    assert running.payback is None
    with pytest.raises(ConfigError, match="payback must be true or false"):
        SpecConfig("speculative", "ngram", payback="no")  # type: ignore[arg-type]


def test_plain_rounds_feed_the_clock_and_a_given_curve_keeps_it_off(tiny: LoadedModel) -> None:
    gen = Generator(tiny, spec=SpecConfig("speculative", "ngram", k=3))
    gen.generate(PROMPT, config=CONFIG)
    clock = gen.plain_clock()
    assert clock is not None
    gen.generate(PROMPT, config=CONFIG, spec=SpecConfig())  # plain decoding's steps count
    assert clock.reference(100) is not None
    given = Generator(
        tiny, spec=SpecConfig("speculative", "ngram", k=3), cost_curve=CostCurve((1, 2), (1.0, 1.1))
    )
    given.generate(PROMPT, config=CONFIG)
    assert given.plain_clock() is None  # draft lengths stay reproducible
