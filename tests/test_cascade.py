"""Draft cascades (`--drafter ngram+head --cascade`): a free source's chain checked and
extended by a head (`CascadeDrafter`, `HeadDrafter.check`): what the head keeps, cuts and adds;
how the cascade asks its stages and labels its drafts; which drafters may form one; greedy
output identical to plain decoding; sampled output distributed as the target's, by a
chi-square test that a cascade with a wrong q fails."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from cli_run import run_cli
from distribution import goodness_of_fit
from head_session import head_session
from specfork.bench.specs import parse_strategy
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import Draft, DraftShape, Feedback, chain_draft
from specfork.drafters.cascade import CascadeDrafter
from specfork.drafters.head import HeadDrafter
from specfork.engine.generator import Generator
from specfork.errors import ConfigError
from specfork.heads.model import DraftHead, HeadConfig, load_head, save_head
from specfork.loading.loader import LoadedModel, load_model
from specfork.sampling import make_generator, probabilities
from tiny_models import tiny_chat_llama

PROMPT = "abcabcabcabcab"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cascade")
    return {"target": tiny_chat_llama(root / "target", chat=False, seed=5), "head": root / "head"}


@pytest.fixture(scope="module")
def tiny(folders: dict[str, Path], one_thread) -> LoadedModel:
    """A tiny random target and a random head for it (draft vocabulary = the target's)."""
    loaded = load_model(str(folders["target"]), dtype="float32", device="cpu", progress=False)
    cfg = loaded.model.config
    torch.manual_seed(3)
    save_head(DraftHead(HeadConfig.for_target(cfg, draft_vocab=cfg.vocab_size)), folders["head"])
    return loaded


def _session(loaded: LoadedModel, folder: Path) -> tuple[HeadDrafter, list[int]]:
    """A head drafter for one request that has seen PROMPT's features; the history."""
    ids = Generator(loaded).encode_prompt(PROMPT)
    return head_session(loaded, folder, PROMPT, ids[-1])


GREEDY = SamplingParams()


def _check(session: HeadDrafter, history, tokens, shape, keep, sampling=GREEDY) -> Draft:
    draft = session.check(history, tokens, shape, sampling, make_generator(0), keep)
    assert draft is not None
    return draft


# ---------------------------------------------------------------------- the head's check


def test_the_head_keeps_cuts_and_extends_a_chain(tiny, folders) -> None:
    session, history = _session(tiny, folders["head"])
    own = session.propose(history, DraftShape(4), GREEDY, make_generator(0)).tokens.tolist()
    assert len(own) == 4
    # kept (keep 0), then the head's own greedy continuation: its own chain again
    assert _check(session, history, own[:2], DraftShape(4), 0.0).tokens.tolist() == own
    # a token the head would not draft is kept when keep allows it, then extended below it
    other = (own[0] + 1) % tiny.model.config.vocab_size
    kept = _check(session, history, [other], DraftShape(3), 0.0).tokens.tolist()
    assert kept[0] == other and len(kept) == 3
    # nothing passes keep > 1: the chain is the head's own from the root
    assert _check(session, history, [other, own[1]], DraftShape(4), 1.01).tokens.tolist() == own
    # the round's depth bounds the whole chain; model_depth the head's own tokens
    assert _check(session, history, [*own, *own], DraftShape(3), 0.0).tokens.tolist() == own[:3]
    short = _check(session, history, [other], DraftShape(4, model_depth=1), 0.0)
    assert short.tokens.tolist() == kept[:2]
    assert len(_check(session, history, [other], DraftShape(4, model_depth=0), 0.0)) == 1


def test_a_token_is_kept_by_its_probability_relative_to_the_heads_favourite(tiny, folders) -> None:
    """keep 1: only the head's own top token passes, a rarer one at the same place is cut
    (the head then drafts its own); keep at the rarer one's ratio lets it pass."""
    session, history = _session(tiny, folders["head"])
    own = session.propose(history, DraftShape(1), GREEDY, make_generator(0))
    top, p_top = int(own.tokens[0]), float(own.scores[0])
    with torch.inference_mode():
        root = session._catch_up(history)  # the head's output at the last committed position
        probs = session._target_probs(session.head.logits(root[None]), GREEDY)  # [V]
    rare = int(probs.argsort()[-2])  # the head's second choice
    ratio = float(probs[rare]) / p_top
    assert 0 < ratio < 1
    assert _check(session, history, [top], DraftShape(1), 1.0).tokens.tolist() == [top]
    assert _check(session, history, [rare], DraftShape(1), 1.0).tokens.tolist() == [top]
    assert _check(session, history, [rare], DraftShape(1), ratio * 0.99).tokens.tolist() == [rare]
    checked = _check(session, history, [top], DraftShape(2), 1.0)
    assert float(checked.scores[0]) == pytest.approx(p_top)  # scores: the head's probabilities


def test_a_sampled_extension_carries_its_q_and_kept_tokens_a_one_hot_row(tiny, folders) -> None:
    session, history = _session(tiny, folders["head"])
    vocab = tiny.model.config.vocab_size
    sampling = SamplingParams(temperature=1.0)
    draft = _check(session, history, [7], DraftShape(3), 0.0, sampling)
    assert draft.q is not None and draft.q.shape == (3, vocab)
    assert draft.tokens[0] == 7 and draft.q[0, 7] == 1.0 and float(draft.q[0].sum()) == 1.0
    torch.testing.assert_close(draft.q.sum(-1), torch.ones(3))
    assert all(draft.q[i, t] > 0 for i, t in enumerate(draft.tokens.tolist()))
    whole = _check(session, history, [7, 8, 9], DraftShape(3), 0.0, sampling)
    assert whole.q is None  # every token kept: a deterministic chain


def test_a_head_without_the_histories_features_cannot_check(tiny, folders) -> None:
    session, history = _session(tiny, folders["head"])
    longer = [*history, 5, 6]  # positions whose features never arrived
    assert session.check(longer, [1], DraftShape(2), GREEDY, make_generator(0), 0.0) is None


# ---------------------------------------------------------------------- the cascade's stages


class Free:
    """A fake free source proposing `tokens` (or nothing)."""

    name, cost, wants_logits = "ngram", 0.0, False

    def __init__(self, tokens: list[int], layers=()) -> None:
        self.tokens, self.hidden_layers = tokens, tuple(layers)
        self.shapes: list[DraftShape] = []
        self.heard: list[Feedback] = []

    def begin(self, prompt_ids):
        return Free(self.tokens, self.hidden_layers)

    def propose(self, history, shape, sampling, rng) -> Draft:
        self.shapes.append(shape)
        return chain_draft(
            torch.tensor(self.tokens[: shape.depth], dtype=torch.long), source="ngram-2"
        )

    def observe(self, feedback: Feedback) -> None:
        self.heard.append(feedback)


class Checker(Free):
    """A fake head: checks by keeping the first token and adding 99; drafts [50] alone."""

    name, cost = "head", 0.2

    def __init__(self, layers=(1, 3), can_check: bool = True) -> None:
        super().__init__([50], layers)
        self.can_check = can_check

    def begin(self, prompt_ids):
        return Checker(self.hidden_layers, self.can_check)

    def check(self, history, tokens, shape, sampling, rng, keep) -> Draft | None:
        if not self.can_check:
            return None
        return chain_draft(torch.tensor([tokens[0], 99]), source=self.name)


def _propose(cascade: CascadeDrafter, shape: DraftShape) -> Draft:
    return cascade.propose([1, 2, 3], shape, GREEDY, torch.Generator())


def test_the_cascade_asks_its_stages_and_labels_the_heads_drafts() -> None:
    free, checker = Free([4, 5, 6, 7]), Checker()
    cascade = CascadeDrafter(free, checker, 0.1)
    long = _propose(cascade, DraftShape(4))  # a long match goes unchecked, priced as free
    assert long.tokens.tolist() == [4, 5, 6, 7] and long.source == "ngram-2"
    assert (cascade.name, cascade.cost, cascade.hidden_layers) == ("ngram>head", 0.2, (1, 3))
    checked = _propose(cascade, DraftShape(3, model_depth=2, confidence=None))
    assert checked.tokens.tolist() == [4, 99] and checked.source == "ngram>head"
    assert free.shapes[-1].model_depth is None  # the free source drafts to the round's depth
    unchecked = _propose(cascade, DraftShape(3, model_depth=0))  # the head does not pay
    assert unchecked.tokens.tolist() == [4, 5, 6] and unchecked.source == "ngram-2"
    free.tokens = []
    alone = _propose(cascade, DraftShape(3))
    assert alone.tokens.tolist() == [50] and alone.source == "ngram>head"
    blind = CascadeDrafter(Free([4, 5]), Checker(can_check=False), 0.1)
    assert _propose(blind, DraftShape(3)).source == "ngram-2"  # the head cannot read yet


def test_both_stages_hear_every_forward_with_their_own_layers() -> None:
    cascade = CascadeDrafter(Free([], layers=(0,)), Checker(layers=(1, 3)), 0.1).begin([1, 2])
    assert cascade.hidden_layers == (0, 1, 3)
    hidden = torch.arange(3.0)[:, None, None].expand(3, 2, 4)  # [C, T, D]: layer index as value
    cascade.observe(Feedback(5, torch.tensor([9, 9]), [0], None, hidden))
    assert cascade.proposer.heard[0].hidden[:, 0, 0].tolist() == [0.0]
    assert cascade.checker.heard[0].hidden[:, 0, 0].tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="runs no network"):
        CascadeDrafter(Checker(), Checker(), 0.1)


@pytest.mark.parametrize(
    ("strategy", "drafter", "words"),
    [
        ("spork", "ngram+head", "for chain strategies"),
        ("dspark", "ngram", "free sources .* checked by a head"),
        ("dspark", "head+ngram", "free sources .* checked by a head"),
        ("speculative", "self+head", "free sources .* checked by a head"),
    ],
)
def test_only_free_sources_and_a_head_form_a_cascade(strategy, drafter, words) -> None:
    with pytest.raises(ConfigError, match=words):
        SpecConfig(strategy, drafter, cascade=True)


def test_a_cascade_is_asked_for_from_every_front_end() -> None:
    assert SpecConfig("dspark", "suffix+ngram+head:/some/head", cascade=True).cascade
    bench = parse_strategy("dspark:ngram+head?cascade=true")
    assert bench.spec == SpecConfig("dspark", "ngram+head", cascade=True)


def test_the_cli_refuses_a_cascade_without_a_head(capsys) -> None:
    argv = ["generate", "-m", "no-such-model", "--drafter", "ngram", "--cascade", "hi"]
    code, out, err = run_cli(capsys, argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "checked by a head" in err


# ---------------------------------------------------------------------- exact output


@pytest.mark.parametrize("strategy", ["speculative", "dspark"])
@pytest.mark.parametrize("free", ["ngram", "suffix+ngram"])
def test_greedy_cascades_give_plain_decodings_output(tiny, folders, strategy, free) -> None:
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = Generator(tiny).generate(PROMPT, config=config)
    extra = {"low": 0.0} if strategy == "dspark" else {}
    drafter = f"{free}+head:{folders['head']}"
    spec = SpecConfig(strategy, drafter, cascade=True, goodput=False, **extra)
    result = Generator(tiny, spec=spec).generate(PROMPT, config=config)
    assert result.token_ids == plain.token_ids
    assert result.stats.drafted > 0


def test_the_cli_decodes_with_a_cascade(tiny, folders, capsys) -> None:
    argv = ["generate", "-m", str(folders["target"]), "--strategy", "dspark", "--drafter"]
    argv += [f"ngram+head:{folders['head']}", "--cascade", "-n", "12", "--ignore-eos", PROMPT]
    code, out, err = run_cli(capsys, argv)
    assert code == 0, err
    assert out.strip()


@pytest.mark.slow
def test_the_shipped_head_cascades_for_the_default_model(smollm_f32) -> None:
    prompt = "Copy this list exactly: apple, banana, cherry, apple, banana, cherry, apple,"
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    plain = Generator(smollm_f32).generate(prompt, config=config)
    spec = SpecConfig("dspark", "ngram+head", cascade=True)
    result = Generator(smollm_f32, spec=spec).generate(prompt, config=config)
    assert result.token_ids == plain.token_ids
    assert result.stats.accepted > 0


# ---------------------------------------------------------------------- the distribution

SAMPLES = 2000
TOP = SamplingParams(temperature=1.0, top_k=3)


class TopOne(Free):
    """A free source proposing the target's most likely next token (read off the model, so
    that the target samples it often and the head's extension follows it)."""

    def __init__(self, model) -> None:
        super().__init__([])
        self.model = model

    def begin(self, prompt_ids):
        return self

    def propose(self, history, shape, sampling, rng) -> Draft:
        m, n = self.model, len(history)
        with torch.inference_mode():
            hidden = m(torch.tensor([history]), torch.arange(n), m.new_cache(n))  # [1, n, D]
        return chain_draft(m.logits(hidden[0, -1]).argmax().view(1), source="top")


class WrongQ(HeadDrafter):
    """A head that gives a kept token half its q instead of a one-hot row (the bug the
    distribution test must catch: the proposal was deterministic, so q is one-hot)."""

    def begin(self, prompt_ids: list[int]) -> WrongQ:
        return WrongQ(self.head, self.model, self.name, self.static_cost, self.meter)

    def check(self, history, tokens, shape, sampling, rng, keep):
        draft = super().check(history, tokens, shape, sampling, rng, keep)
        if draft is None or draft.q is None:
            return draft
        q = draft.q.clone()  # [N, V]
        q[0] = 0.5 * q[0] + 0.5 / q.shape[-1]
        return Draft(draft.tree, q, draft.scores, draft.forwards, draft.source)


def _exact(tiny: LoadedModel, ids: list[int]) -> torch.Tensor:
    """The target's probabilities of its first three sampled tokens [V, V, V] under TOP."""
    model, vocab = tiny.model, tiny.model.config.vocab_size

    def p(prefix: list[int]) -> torch.Tensor:  # [V]
        seq = ids + prefix
        with torch.inference_mode():
            hidden = model(torch.tensor([seq]), torch.arange(len(seq)), model.new_cache(len(seq)))
        return probabilities(model.logits(hidden[0, -1]), TOP).double()  # [V]

    exact = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    p0 = p([])
    for a in p0.nonzero().flatten().tolist():
        p1 = p([a])
        for b in p1.nonzero().flatten().tolist():
            exact[a, b] = p0[a] * p1[b] * p([a, b])
    return exact


def _joint(tiny: LoadedModel, folder: Path, head_type: type[HeadDrafter]) -> tuple:
    """Counts [V, V, V] of the first three tokens sampled with a cascade (the target's top
    token proposed and kept, one head token after it), the exact probabilities, and the
    drafted and accepted tokens."""
    head = head_type(load_head(folder, tiny.model.config), tiny.model)
    cascade = CascadeDrafter(TopOne(tiny.model), head, keep=0.0)
    gen = Generator(tiny, drafter=cascade, spec=SpecConfig("speculative", k=2, goodput=False))
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)  # room for 2 drafts
    vocab = tiny.model.config.vocab_size
    counts = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    tally: Counter = Counter()
    for _ in range(SAMPLES):
        out = gen.generate(PROMPT, config=config, sampling=TOP)
        tally.update(drafted=out.stats.drafted, accepted=out.stats.accepted)
        counts[tuple(out.token_ids[:3])] += 1
    return counts, _exact(tiny, gen.encode_prompt(PROMPT)), tally


@pytest.mark.slow
def test_sampling_through_a_cascade_keeps_the_target_distribution(tiny, folders) -> None:
    counts, exact, tally = _joint(tiny, folders["head"], HeadDrafter)
    assert 0 < tally["accepted"] < tally["drafted"]  # drafts were accepted and rejected
    assert goodness_of_fit(counts.flatten(), exact.flatten()) > 1e-3
    tv = 0.5 * float((counts / counts.sum() - exact).abs().sum())
    assert tv < 0.1, tv  # sampling noise ~0.05 at 2000 samples; a wrong q gave 0.41


@pytest.mark.slow
def test_a_cascade_with_a_wrong_q_fails_the_same_test(tiny, folders) -> None:
    counts, exact, _ = _joint(tiny, folders["head"], WrongQ)
    assert goodness_of_fit(counts.flatten(), exact.flatten()) < 1e-3
