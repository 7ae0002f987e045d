"""`--drafter A+B` for chains: sources asked in order, the first draft wins (`FallbackDrafter`),
each source hearing every forward; the goodput gate prices the costly source's drafts and
lets the free source draft even when the costly one does not pay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import Draft, DraftShape, Feedback, chain_draft
from specfork.drafters.fallback import FallbackDrafter
from specfork.engine.generator import Generator
from specfork.engine.round import gated, observe_gate
from specfork.errors import ConfigError
from specfork.loading.loader import LoadedModel
from specfork.models.cost import CostCurve
from specfork.strategies.goodput import GoodputGate
from specfork.verify import Verdict


class Source:
    """A fake chain source: proposes `tokens` (or nothing), records shapes and feedback."""

    wants_logits = False

    def __init__(self, name: str, tokens: list[int], cost: float = 0.0, layers=()) -> None:
        self.name, self.tokens, self.cost = name, tokens, cost
        self.hidden_layers: tuple[int, ...] = tuple(layers)
        self.shapes: list[DraftShape] = []
        self.heard: list[Feedback] = []
        self.begun = 0

    def begin(self, prompt_ids: list[int]) -> Source:
        self.begun += 1
        return self

    def propose(self, history, shape, sampling, rng) -> Draft:
        self.shapes.append(shape)
        depth = shape.depth if shape.model_depth is None or not self.cost else shape.model_depth
        return chain_draft(torch.tensor(self.tokens[:depth], dtype=torch.long), source=self.name)

    def observe(self, feedback: Feedback) -> None:
        self.heard.append(feedback)


def _propose(drafter: FallbackDrafter, depth: int = 3) -> Draft:
    return drafter.propose([1, 2, 3], DraftShape(depth), SamplingParams(), torch.Generator())


def test_the_first_source_with_a_draft_wins_and_a_costly_one_is_labelled() -> None:
    free, costly = Source("ngram", [], 0.0), Source("head", [7, 8, 9], 0.2, layers=(2, 5))
    fallback = FallbackDrafter([free, costly])
    assert (fallback.name, fallback.cost, fallback.hidden_layers) == ("ngram+head", 0.2, (2, 5))
    draft = _propose(fallback)
    assert draft.tokens.tolist() == [7, 8, 9] and draft.source == "ngram+head"
    free.tokens = [4, 5]
    draft = _propose(fallback)
    assert draft.tokens.tolist() == [4, 5] and draft.source == "ngram"  # the free one's own label
    assert len(costly.shapes) == 1  # not asked once the first source drafted
    free.tokens, costly.tokens = [], []
    assert len(_propose(fallback)) == 0


def test_every_source_hears_every_forward_with_its_own_layers() -> None:
    a = Source("self", [], 0.1, layers=(1, 3))
    b = Source("head", [], 0.2, layers=(3, 6))
    fallback = FallbackDrafter([a, b]).begin([1, 2])
    assert (a.begun, b.begun) == (1, 1) and fallback.hidden_layers == (1, 3, 6)
    hidden = torch.arange(3.0)[:, None, None].expand(3, 2, 4)  # [C, T, D]: layer index as value
    fallback.observe(Feedback(5, torch.tensor([9, 9]), [0], None, hidden))
    assert a.heard[0].hidden[:, 0, 0].tolist() == [0.0, 1.0]  # blocks 1, 3
    assert b.heard[0].hidden[:, 0, 0].tolist() == [1.0, 2.0]  # blocks 3, 6
    with pytest.raises(ValueError, match="two sources"):
        FallbackDrafter([a])


def test_the_gate_prices_only_the_costly_sources_drafts_by_their_scores() -> None:
    """A free source's chain carries scores too (n-gram: 1.0 each); in a fallback they are not
    the network's probabilities, so they neither teach nor use the scored calibration: the
    chain is trimmed by its own source's rates."""
    fallback = FallbackDrafter([Source("ngram-3", []), Source("head", [], cost=0.2)])
    req = SimpleNamespace(gate=GoodputGate(CostCurve((1, 4), (1.0, 1.3))), drafter=fallback)
    ones = torch.ones(3, dtype=torch.float64)  # [3]
    free = chain_draft(torch.tensor([4, 5, 6]), scores=ones, source="ngram-3")
    for _ in range(20):  # the n-gram source is always wrong at its first token
        observe_gate(req, free, free, Verdict([], [9]))
    assert not req.gate.scored.trials  # no calibration learned from free drafts
    assert len(gated(req, free)) == 0  # its rates say nothing pays
    head_q = torch.tensor([0.9, 0.8], dtype=torch.float64)  # [2]
    network = chain_draft(torch.tensor([4, 5]), scores=head_q, source=fallback.name)
    observe_gate(req, network, network, Verdict([0, 1], [4, 5, 6]))
    assert sum(req.gate.scored.trials.values()) == 2  # the head's drafts calibrate its scores
    assert len(gated(req, network)) == 2


@pytest.mark.parametrize(
    ("drafter", "words"),
    [
        ("ngram+recycle", "strategy spork"),
        ("ngram+ngram", "twice"),
        ("ngram+eagle", "unknown drafter 'eagle'"),
        ("ngram+", "unknown drafter ''"),
    ],
)
def test_chain_sources_are_checked(drafter: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        SpecConfig("speculative", drafter)


@pytest.mark.parametrize("drafter", ["recycle+recycle", "ngram+recycle+ngram"])
def test_spork_sources_are_named_once(drafter: str) -> None:
    with pytest.raises(ConfigError, match="names a source twice"):
        SpecConfig("spork", drafter)


def test_a_backwards_layer_range_says_so() -> None:
    from specfork.drafters.model import parse_layers

    with pytest.raises(ConfigError, match="'9-3' runs backwards: write 3-9"):
        parse_layers("0,9-3", 30)
    assert parse_layers("3-9", 30) == list(range(3, 10))
    SpecConfig("dspark", "ngram+head:/some/head+model:/some/draft.gguf")  # any order, any count


N = 40
PROMPT = "Copy this list exactly: apple, banana, cherry, apple, banana, cherry."


@pytest.mark.slow
def test_the_free_source_drafts_when_the_costly_one_does_not_pay(
    smollm_f32: LoadedModel,
) -> None:
    """A costly source that never agrees is turned off by the gate (`model_depth` 0 but for
    exploration rounds), while the n-gram source keeps drafting at full depth; output is
    plain decoding's."""
    from specfork.drafters.ngram import NgramDrafter

    config = GenerationConfig(max_new_tokens=N, ignore_eos=True)
    plain = Generator(smollm_f32).generate(PROMPT, config=config)
    never = max(set(range(100, 200)) - set(plain.token_ids))
    costly = Source("head", [never] * 8, cost=0.3)
    fallback = FallbackDrafter([NgramDrafter(), costly])
    curve = CostCurve((1, 2, 4, 8), (1.0, 1.1, 1.3, 2.0))
    gen = Generator(
        smollm_f32, drafter=fallback, spec=SpecConfig("speculative", k=4), cost_curve=curve
    )
    out = gen.generate(PROMPT, config=config)
    assert out.token_ids == plain.token_ids
    depths = [s.model_depth for s in costly.shapes]
    assert depths and depths[-5:].count(0) >= 3  # turned off after its misses
    assert all(s.depth >= 1 for s in costly.shapes)  # the free source's depth stays
    assert out.stats.accepted > 0  # the n-gram source drafted and was right
