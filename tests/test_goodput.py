"""The goodput gate (specfork.strategies.goodput): cost-aware draft lengths and tree budgets.

Unit tests of the arithmetic, then the gate inside the engine: a drafter that is always wrong
is turned off after a few rounds, one that is always right keeps its whole draft, and in both
cases the output is plain decoding's.
"""

from __future__ import annotations

import pytest
import torch

from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import Draft, Feedback, chain_draft
from specfork.drafters.meter import CostMeter
from specfork.engine.generator import Generator
from specfork.loading.loader import LoadedModel
from specfork.models.cost import CostCurve
from specfork.models.cost_calibration import CostCalibration
from specfork.strategies.goodput import (
    EXPLORE_EVERY,
    AcceptanceStats,
    GoodputGate,
    NoGate,
    TreeGate,
    best_length,
    new_gate,
    would_accept,
)
from specfork.tree import Tree, chain
from specfork.verify import Verdict

FLAT = CostCurve((1, 32), (1.0, 1.0))  # extra rows free
STEEP = CostCurve((1, 2, 4, 8), (1.0, 2.0, 4.0, 8.0))  # linear: speculation cannot pay


def test_cost_curve_interpolates_and_extrapolates() -> None:
    curve = CostCurve((1, 2, 4), (1.0, 1.2, 1.6))
    assert curve(1) == 1.0 and curve(3) == pytest.approx(1.4)
    assert curve(6) == pytest.approx(2.0)  # the last slope continues
    assert curve(0) == 1.0


def _far_curve() -> CostCurve:
    """Near (context 192): 8 rows cost 1.2 steps; far (context 1216): every row a whole step's
    attention, and one row there is twice the near one."""
    rows = (1, 2, 4, 8)
    far = CostCurve(rows, (1.0, 2.0, 4.0, 8.0), 1216)
    return CostCurve(rows, (1.0, 1.05, 1.1, 1.2), 192, far, 2.0)


def test_a_curve_moves_with_the_context_between_its_two_measurements() -> None:
    curve = _far_curve()
    assert curve.at(100) is curve and curve.at(192) is curve
    assert CostCurve((1, 2), (1.0, 1.1)).at(5000)(2) == 1.1  # no far curve: context-blind
    far = curve.at(1216)
    assert far.context == 1216 and far(8) == pytest.approx(8.0)  # the far measurement itself
    mid = curve.at(704)  # halfway: 8 rows take (1.2 + 16) / 2 near steps, one row (1 + 2) / 2
    assert mid(8) == pytest.approx((1.2 + 16.0) / 2 / 1.5)
    beyond = curve.at(4000)  # past the far measurement: times keep growing linearly
    assert beyond(8) > far(8) and beyond(1) == 1.0
    assert curve.at(750) is curve.at(760)  # contexts in steps of 64 share one curve


def test_the_gate_verifies_fewer_rows_at_a_long_context() -> None:
    gate = GoodputGate(_far_curve())
    for _ in range(20):
        gate.observe("s", [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9])  # three of seven accepted
    assert gate.length("s", 7) >= 3
    gate.at_context(4000)
    assert gate.length("s", 7) == 0  # every row a step: speculation cannot pay
    gate.at_context(192)
    assert gate.length("s", 7) >= 3


def test_best_length() -> None:
    assert best_length([0.9] * 8, FLAT) == 8  # free rows: draft everything
    assert best_length([0.05] * 8, CostCurve((1, 2), (1.0, 1.1))) == 0  # 1.05 tokens for 1.1
    assert best_length([0.9] * 8, STEEP) == 0  # rows cost as much as steps
    moderate = CostCurve((1, 2, 3, 4, 5), (1.0, 1.2, 1.4, 1.6, 1.8))
    # E(k)/c(k+1) for a = 0.8: 1.8/1.2 = 1.50, 2.44/1.4 = 1.74, 2.95/1.6 = 1.85, 3.36/1.8 = 1.87
    assert best_length([0.8] * 4, moderate) == 4
    assert best_length([0.8, 0.8, 0.1, 0.1], moderate) == 2
    assert best_length([0.9] * 4, FLAT, draft_cost=0.7) < 4  # a draft model's tokens cost too


def test_acceptance_stats_learn_from_emitted_tokens() -> None:
    stats = AcceptanceStats()
    prior = stats.rates("s", 3)
    assert prior == [0.5, 0.5, 0.5]
    for _ in range(8):
        stats.observe("s", [1, 2, 3], [1, 2, 9])  # positions 1-2 accepted, 3 rejected
    a1, a2, a3 = stats.rates("s", 3)
    assert a1 > 0.8 and a2 > 0.8 and a3 < 0.2
    stats.observe("t", [5, 6], [7])  # only position 1 observed (one token emitted)
    assert stats.trials["t"] == [1.0] and stats.hits["t"] == [0.0]


def test_a_costly_drafter_the_gate_turned_off_still_explores() -> None:
    gate = GoodputGate(STEEP)
    lengths = [gate.length("model", 4, draft_cost=0.5) for _ in range(3 * EXPLORE_EVERY)]
    assert lengths.count(1) == 3 and set(lengths) == {0, 1}
    assert GoodputGate(FLAT).length("ngram-3", 4) == 4  # free rows, prior 0.5: worth it


def test_tree_gate_keeps_the_best_nodes_while_they_pay() -> None:
    gate = TreeGate(CostCurve((1, 2, 3, 4, 5), (1.0, 1.2, 1.4, 1.6, 1.8)))
    scores = [1.0, 0.5, 1.0, 0.25]  # nodes 0 and 2 score best
    keep = gate.keep(scores, [-1, -1, 0, 1])
    assert keep == [True, True, False, False]  # priors 0.5 a level: depth 2 is worth 0.25
    for _ in range(20):  # nodes like 0 and 2 always on the path, the others never
        gate.observe(scores, [-1, -1, 0, 1], [0, 2])
    assert gate.keep(scores, [-1, -1, 0, 1]) == [True, False, True, False]
    free = TreeGate(FLAT)
    assert free.keep(scores, [-1, -1, 0, 1]) == [True, True, True, True]


def test_no_gate_verifies_everything_and_learns_nothing() -> None:
    gate = NoGate()
    draft = chain_draft(torch.tensor([4, 5, 6]), source="ngram-3")
    assert gate.trim(draft, costly=False) is draft
    assert gate.values(draft, [0, 1, 2]) is None and gate.first_rate() is None
    assert gate.depth_for("model", 4, 0.5) is None
    gate.learn(draft, draft, Verdict([], [9]), costly=False)


def test_the_chain_gate_through_its_protocol() -> None:
    """What the engine calls: trim by the source's rates, values as running products, learn
    from the proposal, the best first rate; trees are not its to value."""
    gate = GoodputGate(STEEP)
    draft = chain_draft(torch.tensor([4, 5, 6]), source="ngram-3")
    assert len(gate.trim(draft, costly=False)) == 0  # linear cost: nothing pays at the prior
    assert gate.values(draft, [0, 1, 2]) == pytest.approx([0.5, 0.25, 0.125])
    for _ in range(10):
        gate.learn(draft, draft.head(0), Verdict([], [4, 5, 6, 7]), costly=False)
    rates = gate.stats.rates("ngram-3", 3)
    assert gate.values(draft, [0, 1, 2]) == pytest.approx(
        [rates[0], rates[0] * rates[1], rates[0] * rates[1] * rates[2]]
    )
    assert gate.first_rate() == pytest.approx(rates[0]) and rates[0] > 0.9
    assert gate.depth_for("model", 3, 0.0) == 0  # linear cost: a prior model does not pay
    assert GoodputGate(FLAT).depth_for("model", 3, 0.0) == 3  # free rows: it does
    # a chain joined from two sources (forced tokens, then a drafter's): each run of nodes by
    # its own source's rates from that source's first position
    joined = Draft(
        chain([1, 2, 4, 5]), source="grammar", origins=("grammar",) * 2 + ("ngram-3",) * 2
    )
    prior = gate.stats.rates("grammar", 2)
    forced = prior[0] * prior[1]
    expected = [prior[0], forced, forced * rates[0], forced * rates[0] * rates[1]]
    assert gate.values(joined, [0, 1, 2, 3]) == pytest.approx(expected)
    assert gate.depth_for("model", 0, 0.0) is None
    tree = Draft(Tree(torch.tensor([4, 5]), torch.tensor([-1, -1])), source="forks")
    assert gate.values(tree, [0, 1]) is None


def test_the_tree_gate_through_its_protocol() -> None:
    gate = TreeGate(CostCurve((1, 2, 3, 4, 5), (1.0, 1.2, 1.4, 1.6, 1.8)))
    scores = torch.tensor([1.0, 0.5, 1.0, 0.25], dtype=torch.float64)  # [4]
    tree = Tree(torch.tensor([10, 11, 12, 13]), torch.tensor([-1, -1, 0, 1]))  # depths 1 1 2 2
    draft = Draft(tree, scores=scores, source="forks")
    kept = gate.trim(draft, costly=False)
    assert kept.tokens.tolist() == [10, 11]  # as `keep` says: 0.5 a level, depth 2 worth 0.25
    assert gate.values(draft, [0, 2, 1, 3]) == pytest.approx([0.5, 0.25, 0.5, 0.25])
    assert gate.first_rate() == 0.5  # asked before learning: it follows the counts after
    for _ in range(20):
        gate.learn(draft, draft, Verdict([0, 2], [10, 12, 7]), costly=False)
    assert gate.trim(draft, costly=False).tokens.tolist() == [10, 12]
    assert gate.depth_for("model", 3, 0.5) is None
    # node 10 (depth 1) was on every accepted path, node 11 on none: the best first level
    assert gate.first_rate() == pytest.approx((20 + 0.5 * 2) / (20 + 2))
    assert TreeGate(FLAT).first_rate() == 0.5  # nothing seen: the prior
    unscored = Draft(tree, source="forks")
    assert gate.trim(unscored, costly=False) is unscored
    assert gate.values(unscored, [0, 1, 2, 3]) is None


def test_a_scored_chain_is_trimmed_where_its_calibrated_scores_stop_paying() -> None:
    """A costly drafter's chain carries its own cumulative q: the gate learns how often tokens
    of each score are accepted and verifies only the head of the chain that pays."""
    gate = GoodputGate(CostCurve((1, 2, 3, 4, 5), (1.0, 1.1, 1.2, 1.3, 1.4)))
    scores = [0.9, 0.8, 0.1, 0.05]  # confident, confident, then unsure (steps .9 .89 .13 .5)
    # priors: 0.5 a level, capped by the step score: 0.5, 0.25, 0.03, 0.02 — the tail is not
    # worth a tenth of a step
    assert gate.trim_scored(scores) == 2
    for _ in range(20):  # the confident tokens are always accepted, the unsure never
        gate.observe_scored(scores, [1, 2, 3, 4], [1, 2, 7])
    assert gate.trim_scored(scores) == 2
    wrong = GoodputGate(gate.cost)
    for _ in range(20):  # a drafter whose confident tokens are always rejected
        wrong.observe_scored(scores, [1, 2, 3, 4], [5])
    assert wrong.trim_scored(scores) == 0  # nothing pays: a plain step
    fresh = GoodputGate(FLAT)
    assert fresh.trim_scored(scores) == 4  # free rows: verify everything drafted


def test_scored_chains_teach_only_what_the_emitted_tokens_show() -> None:
    gate = GoodputGate(FLAT)
    gate.observe_scored([0.9, 0.6, 0.3], [1, 2, 3], [1, 9])  # broke at 2: below it, not counted
    assert sum(gate.scored.trials.values()) == 2 and sum(gate.scored.hits.values()) == 1
    gate = GoodputGate(FLAT)
    gate.observe_scored([0.9, 0.6, 0.3], [1, 2, 3], [1, 2])  # node 3 never judged
    assert sum(gate.scored.trials.values()) == 2 and sum(gate.scored.hits.values()) == 2


class WrongDrafter:
    """Always proposes k copies of a token the model does not emit next (never accepted)."""

    name = "wrong"
    cost = 0.0
    wants_logits = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, token: int) -> None:
        self.token = token

    def begin(self, prompt_ids: list[int]) -> None:
        return None

    def propose(self, history, shape, sampling, rng) -> Draft:
        return chain_draft(torch.full((shape.depth,), self.token), source="wrong")

    def observe(self, feedback: Feedback) -> None:
        return None


class OracleDrafter(WrongDrafter):
    """Proposes exactly what plain decoding emits next (always accepted)."""

    def __init__(self, tokens: list[int], prompt_len: int) -> None:
        self.tokens, self.prompt_len = tokens, prompt_len

    def propose(self, history, shape, sampling, rng) -> Draft:
        budget = shape.depth
        at = len(history) - self.prompt_len
        tokens = torch.tensor(self.tokens[at : at + budget], dtype=torch.long)  # [K]
        return chain_draft(tokens, source="oracle")


N = 40
PROMPT = "Write one sentence about the moon."


@pytest.mark.slow
def test_the_gate_turns_a_useless_drafter_off_and_keeps_a_perfect_one(
    smollm_f32: LoadedModel,
) -> None:
    config = GenerationConfig(max_new_tokens=N, ignore_eos=True)
    plain = Generator(smollm_f32).generate(PROMPT, config=config)
    never = max(set(range(100, 200)) - set(plain.token_ids))  # a token plain never emits
    # a CPU-like curve (an fp32 model is so memory-bound that rows cost almost nothing)
    curve = CostCurve((1, 2, 4, 8), (1.0, 1.25, 1.6, 2.4))
    gated = Generator(
        smollm_f32,
        drafter=WrongDrafter(never),
        spec=SpecConfig("speculative", k=5),
        cost_curve=curve,
    )
    ungated = Generator(
        smollm_f32,
        drafter=WrongDrafter(never),
        spec=SpecConfig("speculative", k=5, goodput=False),
    )
    a, b = gated.generate(PROMPT, config=config), ungated.generate(PROMPT, config=config)
    assert a.token_ids == b.token_ids == plain.token_ids
    assert b.stats.drafted > 4 * (N - 5)  # k = 5 every round, all rejected
    assert a.stats.drafted < b.stats.drafted / 4  # cut after a few rejected rounds
    assert a.stats.accepted == b.stats.accepted == 0
    oracle = OracleDrafter(plain.token_ids, len(plain.prompt_ids))
    right = Generator(
        smollm_f32, drafter=oracle, spec=SpecConfig("speculative", k=4), cost_curve=curve
    )
    c = right.generate(PROMPT, config=config)
    assert c.token_ids == plain.token_ids
    assert c.stats.acceptance_rate == 1.0 and c.stats.mean_accepted_length > 3


@pytest.mark.slow
def test_gated_sampling_stays_reproducible(smollm_f32: LoadedModel) -> None:
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    sampling = SamplingParams(temperature=0.8, seed=3)
    gen = Generator(smollm_f32, spec=SpecConfig("speculative", "ngram", k=4))
    first = gen.generate(PROMPT, config=config, sampling=sampling)
    again = gen.generate(PROMPT, config=config, sampling=sampling)
    assert first.token_ids == again.token_ids


def test_the_cost_meter_takes_the_lower_quartile_of_recent_proposals() -> None:
    meter = CostMeter(target_seconds=0.01, floor=0.1, window=8)
    assert meter.cost == 0.1  # nothing measured yet: the static estimate
    meter.observe(0.004, 2)  # 2 ms a token = 0.2 target steps
    assert meter.cost == pytest.approx(0.2)
    meter.observe(0.5, 0)  # nothing drafted: not a measurement
    assert meter.cost == pytest.approx(0.2)
    meter.observe(0.1, 1)  # a slow spell (100 ms): timing noise only ever adds time
    assert meter.cost == pytest.approx(0.2)  # the least of fewer than five
    meter.observe(0.006, 2)
    meter.observe(0.009, 3)
    meter.observe(0.0125, 5)  # 2, 100, 3, 3, 2.5 ms: the lower quartile is 2.5 ms
    assert meter.per_token == pytest.approx(0.0025)
    assert meter.cost == pytest.approx(0.25)
    for _ in range(8):  # the window forgets what came before
        meter.observe(0.03, 1)
    assert meter.cost == pytest.approx(3.0)
    for _ in range(8):
        meter.observe(0.0, 1)
    assert meter.cost == 0.1  # never below the floor
    for bad, words in (
        ({"target_seconds": 0.0}, "target_seconds"),
        ({"floor": -1.0}, "floor"),
        ({"window": 0}, "window"),
        ({"window": 2.5}, "window"),
    ):
        with pytest.raises(ValueError, match=words):
            CostMeter(**{"target_seconds": 0.01, "floor": 0.1, **bad})


def test_a_slow_first_proposal_does_not_keep_the_gate_off() -> None:
    """A first proposal on cold caches (5x the usual) prices the head out; the next timed
    proposal (an exploration round) restores the usual price, where a moving average would
    have kept most of the spike."""
    meter = CostMeter(target_seconds=0.004, floor=0.05)
    meter.observe(0.005, 1)  # 5 ms: more than a target step
    assert meter.cost == pytest.approx(1.25)
    meter.observe(0.0003, 1)
    assert meter.cost == pytest.approx(0.075)


def test_an_unseen_tree_bucket_starts_from_its_depths_pooled_rate() -> None:
    gate = TreeGate(FLAT)
    assert gate.probability(0.25, 1) == 0.25  # nothing seen: the prior, capped by the score
    tree = Tree(torch.tensor([10, 11]), torch.tensor([-1, -1]))  # two first-level forks
    draft = Draft(tree, scores=torch.tensor([1.0, 0.5], dtype=torch.float64), source="forks")
    for _ in range(30):  # neither is ever accepted
        gate.learn(draft, draft, Verdict([], [7]), costly=False)
    assert gate.probability(0.25, 1, "forks") < 0.05  # an octave never tried: depth 1 pays rarely
    assert gate.probability(0.25, 2, "forks") == 0.25  # another depth: still the prior


def test_would_accept_reads_the_emitted_tokens_along_each_path() -> None:
    # root ─ 10 ─ 12 ─ 14      emitted 10 12 7: node 0 and 2 verified on the path,
    #      │    └ 13           node 1 (11) a miss, node 4 (15) below it a miss too,
    #      └ 11 ─ 15           node 3 (13) a miss at depth 2, node 5 (14) at depth 3 ≠ 7
    tokens, parents = [10, 11, 12, 13, 15, 14], [-1, -1, 0, 0, 1, 2]
    hits = would_accept(tokens, parents, Verdict([0], [10, 12, 7]))
    assert hits == [True, False, True, False, False, False]  # node 2 trimmed, yet a hit
    # only the target's own token emitted: depth 2 and below are not known
    hits = would_accept(tokens, parents, Verdict([], [10]))
    assert hits == [True, False, None, None, False, None]


def test_a_trimmed_bucket_goes_on_learning_and_comes_back() -> None:
    """A tree gate learns from every proposed node, verified or not: a node that does not pay
    at the prior is trimmed, and once the target emits its token round after round it is
    verified again."""
    gate = TreeGate(CostCurve((1, 2, 3, 4), (1.0, 1.7, 2.4, 3.1)))  # a row: 0.7 of a step
    tree = Tree(torch.tensor([10, 11, 12]), torch.tensor([-1, -1, 0]))
    draft = Draft(tree, scores=torch.tensor([0.9, 0.4, 0.5], dtype=torch.float64), source="forks")
    assert len(gate.trim(draft, costly=False)) == 0 and gate.first_rate() == 0.0
    for _ in range(30):  # nothing verified; the target's own token is 10 each round
        kept = gate.trim(draft, costly=False)
        gate.learn(draft, kept, Verdict([0] if len(kept) else [], [10]), costly=False)
    assert gate.probability(0.9, 1, "forks") > 0.9 and gate.probability(0.4, 1, "forks") < 0.1
    assert gate.trim(draft, costly=False).tokens.tolist() == [10]
    assert gate.first_rate() > 0.9  # the scheduler drafts for it again


def test_the_tree_gate_tells_its_sources_apart() -> None:
    """Two sources' first nodes both score 1: the gate learns that one of them is accepted
    and the other is not, and spends rows on the first only (one bucket per source)."""
    gate = TreeGate(CostCurve((1, 2, 3, 4, 5), (1.0, 1.3, 1.6, 1.9, 2.2)))  # a row: 0.3 step
    tree = Tree(torch.tensor([10, 11, 12, 13]), torch.tensor([-1, -1, 0, 1]))
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    origins = ("suffix", "recycle", "suffix", "recycle")
    draft = Draft(tree, scores=scores, source="suffix+recycle", origins=origins)
    assert len(gate.trim(draft, costly=False)) == 2  # the prior: 0.5 a level
    for _ in range(20):  # the suffix chain 10 12 is right every time
        gate.learn(draft, draft, Verdict([0, 2], [10, 12, 9]), costly=False)
    assert gate.trim(draft, costly=False).tokens.tolist() == [10, 12]
    assert gate.probability(1.0, 1, "recycle") < 0.1 < 0.9 < gate.probability(1.0, 1, "suffix")
    # a recycled node below a wrong one is worth no more than its parent, whatever its bucket
    assert gate.values(draft, [0, 1, 2, 3])[3] <= gate.values(draft, [0, 1, 2, 3])[1]


def test_a_position_never_reached_starts_from_the_one_before_it() -> None:
    """Rounds that verified three tokens, all accepted, observe positions 1-3 only: position 4
    and beyond start from position 3's rate, not from the prior, so the gate drafts deeper
    at once when rows are cheap enough (a copied span accepted whole goes on being copied)."""
    gate = GoodputGate(CostCurve((1, 2, 9), (1.0, 1.3, 3.4)))  # a row: 0.3 of a step
    assert gate.length("suffix-8", 8) == 1  # the prior 0.5 everywhere: one token pays best
    for _ in range(10):
        gate.observe("suffix-8", [1, 2, 3], [1, 2, 3, 4])
    rates = gate.stats.rates("suffix-8", 8)
    assert rates[0] == pytest.approx((10 + 0.5 * 2) / 12)  # observed, from the prior
    assert rates[1] == pytest.approx((10 + rates[0] * 2) / 12)  # ... from position 1's rate
    assert rates[3:] == pytest.approx([rates[2]] * 5)  # not observed: position 3's rate
    assert gate.length("suffix-8", 8) >= 6
    assert gate.stats.rates("other", 3) == [0.5, 0.5, 0.5]  # a source never seen: the prior


@pytest.mark.parametrize("tree", [False, True])
def test_a_gate_trims_before_it_knows_its_context(tree: bool) -> None:
    """A gate holds the Generator's pricing (a `CostCalibration`) until its first
    `at_context`; a round can trim before that (the grammar's forced tokens, drafted while the
    drafter itself is paused), so trimming must price rows with it as they are."""
    gate = new_gate(tree, CostCalibration(FLAT))
    scores = torch.tensor([0.9, 0.8, 0.7], dtype=torch.float64)
    scored = chain_draft(torch.tensor([4, 5, 6]), scores=scores, source="suffix-8")
    assert len(gate.trim(scored, costly=False)) == 3  # free rows: all of it pays
    assert len(gate.trim(chain_draft(torch.tensor([4, 5]), source="grammar"), costly=False)) == 2
