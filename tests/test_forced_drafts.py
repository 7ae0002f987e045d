"""Drafting the tokens a grammar forces (engine/forced.py): what is forced, exactness of every
strategy with and without them, seeded sampling, and drafters told when a round verified
tokens that were not theirs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from cli_run import run_cli
from specfork import Constraint, GenerationConfig, Generator, SamplingParams, load_model
from specfork.config import SpecConfig
from specfork.drafters.base import Draft, DraftShape, Feedback, follow
from specfork.drafters.fallback import FallbackDrafter
from specfork.drafters.model import ModelDrafter
from specfork.drafters.ngram import NgramDrafter
from specfork.drafters.suffix import SuffixDrafter
from specfork.drafters.suffix_index import SuffixIndex, SuffixLimits
from specfork.engine.batch import BatchConfig, generate_batch
from specfork.engine.grammar import FORCED_BYTES, GrammarState, grammar_tokenizer
from specfork.loading.loader import LoadedModel
from specfork.strategies.policies import RoundInfo
from tiny_models import tiny_chat_llama

# a record whose keys and punctuation the grammar forces, values left to the model
RECORD = r'\{"name": "[a-z]{1,6}", "size": [0-9]{1,3}, "kind": "(cat|dog|bird)"\}'
SPECS = {
    "ngram": SpecConfig("speculative", k=4),
    "suffix": SpecConfig("speculative", drafter="suffix"),
    "dspark": SpecConfig("dspark"),
    "spork": SpecConfig("spork", drafter="recycle+ngram"),
    "self": SpecConfig("speculative", drafter="self", self_layers="0-0", k=3, goodput=False),
}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with a byte-level tokenizer (one token per byte)."""
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-forced"), seed=5, eos_token_id=258)


@pytest.fixture(scope="module")
def tiny(tiny_folder: Path) -> LoadedModel:
    return load_model(str(tiny_folder), dtype="float32", device="cpu", progress=False)


def _state(loaded: LoadedModel, pattern: str) -> GrammarState:
    vocab = loaded.config.vocab_size
    return GrammarState(
        Constraint.regex(pattern), grammar_tokenizer(loaded.tokenizer, vocab), vocab
    )


def _ids(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def test_forced_tokens_are_the_bytes_every_continuation_starts_with(tiny: LoadedModel) -> None:
    state = _state(tiny, RECORD)
    assert state.forced(64) == _ids(tiny, '{"name": "')
    assert state.forced(3) == _ids(tiny, '{"n')  # at most `limit`
    assert state.forced(0) == []
    state.advance(_ids(tiny, '{"name": "ab'))
    assert state.forced(64) == []  # the name goes on or ends: open
    state.advance(_ids(tiny, '"'))
    assert state.forced(64) == _ids(tiny, ', "size": ')
    state.advance(_ids(tiny, ', "size": 7, "kind": "'))
    assert state.forced(64) == []  # cat, dog or bird
    state.advance(_ids(tiny, "b"))
    assert state.forced(64) == _ids(tiny, 'ird"}')
    state.advance(_ids(tiny, 'ird"}'))
    assert state.forced(64) == []  # complete: nothing is drafted past the end


@pytest.mark.usefixtures("one_thread")
def test_every_strategy_equals_constrained_plain_with_and_without_forced_drafts(
    tiny: LoadedModel,
) -> None:
    config = GenerationConfig(max_new_tokens=80, constraint=Constraint.regex(RECORD))
    prompts = ["Give a record.", "Another record, please.", "A third one."]
    plain = Generator(tiny)
    refs = [plain.generate(p, config=config) for p in prompts]
    assert all(r.finish_reason == "stop" for r in refs)
    assert all(r.stats.by_source == {} for r in refs)  # plain decoding never drafts them
    for name, spec in SPECS.items():
        for on in (True, False):
            gen = Generator(tiny, spec=SpecConfig(**{**_fields(spec), "grammar_drafts": on}))
            drafted = accepted = 0
            for prompt, ref in zip(prompts, refs, strict=True):
                got = gen.generate(prompt, config=config)
                assert got.token_ids == ref.token_ids, (name, on, prompt)
                d, a = got.stats.by_source.get("grammar", [0, 0])
                drafted, accepted = drafted + d, accepted + a
            if on:  # the keys and punctuation came from the grammar, and were accepted
                assert accepted >= 10 and accepted == drafted, (name, drafted, accepted)
            else:
                assert drafted == 0, name


def _fields(spec: SpecConfig) -> dict:
    names = ("strategy", "drafter", "k", "self_layers", "goodput")
    return {n: getattr(spec, n) for n in names}


@pytest.mark.usefixtures("one_thread")
def test_seeded_sampling_with_forced_drafts_equals_plain_sampling(tiny: LoadedModel) -> None:
    """With a seed every position's draw is keyed to it, so any lossless strategy gives plain
    sampling's very output: forced drafts accepted by the sampling rule change nothing."""
    config = GenerationConfig(max_new_tokens=60, constraint=Constraint.regex(RECORD))
    plain, spec = Generator(tiny), Generator(tiny, spec=SPECS["suffix"])
    forced = 0
    for seed in range(12):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        ref = plain.generate("Give a record.", config=config, sampling=sampling)
        got = spec.generate("Give a record.", config=config, sampling=sampling)
        assert got.token_ids == ref.token_ids, seed
        forced += got.stats.by_source.get("grammar", [0, 0])[1]
    assert forced > 0


def test_a_model_drafter_drops_its_cached_draft_when_the_round_was_not_its_own(
    tiny: LoadedModel,
) -> None:
    history = _ids(tiny, "Give a record.")
    drafter = ModelDrafter(tiny.model, layers=[0], name="self").begin(history)
    draft = drafter.propose(history, DraftShape(4), SamplingParams(), torch.Generator())
    assert len(draft) == 4 and drafter.cache is not None
    cached = drafter.cache.length  # the history and the draft's first tokens
    assert cached > len(history)
    rows = torch.tensor([history[-1], 11, 12])  # root and two forced tokens, both accepted
    own = Feedback(len(history) + 2, rows, [0, 1])
    other = Feedback(len(history) + 2, rows, [0, 1], own=False)
    drafter.observe(own)
    assert drafter.cache.length == min(cached, len(history) + 2)  # kept as its own tokens
    drafter.observe(other)
    assert drafter.cache.length == len(history) - 1  # from the round's root on: dropped


# ----------------------------------------------------------------------------- follow


def test_ngram_follow_reads_past_a_tail_without_learning_it() -> None:
    drafter = NgramDrafter(max_ngram=3).begin([])
    history = [5, 6, 7, 8, 9, 1, 2, 5, 6]
    assert follow(drafter, history, [7], 3).tokens.tolist() == [8, 9, 1]  # after 5 6 7
    assert follow(drafter, history, [7, 8, 9], 9).tokens.tolist() == [1, 2, 5, 6]
    assert follow(drafter, history, [3], 3).tokens.tolist() == []  # 3 never occurred
    assert follow(drafter, history, [7], 0).tokens.tolist() == []
    shape = DraftShape(2)
    after = drafter.propose(history, shape, SamplingParams(), torch.Generator())
    assert after.tokens.tolist() == [7, 8]  # the tail was not indexed as history


def test_suffix_follow_only_reads_the_shared_index() -> None:
    index = SuffixIndex(SuffixLimits())
    earlier = SuffixDrafter(index).begin([1, 2, 3, 4, 5, 6, 7])
    earlier.propose([1, 2, 3, 4, 5, 6, 7], DraftShape(1), SamplingParams(), torch.Generator())
    mine = SuffixDrafter(index).begin([9, 9, 1, 2])
    tokens = index.tokens
    draft = follow(mine, [9, 9, 1, 2], [3, 4], 3)
    assert draft.tokens.tolist() == [5, 6, 7] and draft.source.startswith("suffix-")
    assert index.tokens == tokens  # nothing was indexed
    assert follow(
        FallbackDrafter([NgramDrafter(), mine]), [9, 9, 1, 2], [3, 4], 2
    ).tokens.tolist() == [5, 6]


def test_a_drafter_without_follow_gives_nothing_after_a_tail() -> None:
    class Plain:
        name, cost, wants_logits, hidden_layers = "plain", 0.0, False, ()

    assert len(follow(Plain(), [1, 2, 3], [4], 5)) == 0  # type: ignore[arg-type]


class _SpyNgram(NgramDrafter):
    """An n-gram drafter that records what it was asked to follow and what it was told."""

    def __init__(self, log: list | None = None) -> None:
        super().__init__(max_ngram=3)
        self.log = [] if log is None else log

    def begin(self, prompt_ids: list[int]) -> _SpyNgram:
        return _SpyNgram(self.log)

    def follow(self, history: list[int], tail: list[int], depth: int) -> Draft:
        draft = super().follow(history, tail, depth)
        self.log.append(("follow", list(tail), draft.tokens.tolist()))
        return draft

    def observe(self, feedback: Feedback) -> None:
        self.log.append(("observe", feedback.own, feedback.tokens.tolist()))


@pytest.mark.usefixtures("one_thread")
def test_the_drafter_continues_past_the_forced_tokens_in_the_same_round(
    tiny: LoadedModel,
) -> None:
    config = GenerationConfig(max_new_tokens=80, constraint=Constraint.regex(RECORD))
    prompt = 'Like {"name": "rex", "size": 12, "kind": "dog"}, give a record.'
    ref = Generator(tiny).generate(prompt, config=config)
    spy = _SpyNgram()
    spec = SpecConfig("speculative", k=8, goodput=False)
    got = Generator(tiny, spec=spec, drafter=spy).generate(prompt, config=config)
    assert got.token_ids == ref.token_ids
    followed = [(tail, out) for kind, tail, out in spy.log if kind == "follow" and out]
    assert followed, spy.log  # after '{"name": "' the prompt's record goes on with 'rex"'
    verified = [rows for kind, own, rows in spy.log if kind == "observe" and not own]
    assert any(
        rows[1 : 1 + len(tail) + 1] == tail + out[:1] for tail, out in followed for rows in verified
    )  # a round's rows: the root, the forced tokens, then the drafter's continuation


class _SpyPolicy:
    """A constant draft length of 4 that records what every round told it."""

    name = "spy"

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def begin(self) -> _SpyPolicy:
        return self

    def next_shape(self, generated: int) -> DraftShape:
        return DraftShape(4)

    def update(self, info: RoundInfo) -> None:
        self.seen.append((info.drafted, info.accepted))

    def trace(self) -> dict:
        return {}


@pytest.mark.usefixtures("one_thread")
def test_the_policy_learns_from_its_drafter_rounds_only(tiny: LoadedModel) -> None:
    """Rounds that verified forced tokens tell the policy it drafted nothing: DSpark's EMA,
    SPORK's forks and HF's heuristic K must not rise on the grammar's certainties."""
    config = GenerationConfig(max_new_tokens=80, constraint=Constraint.regex(RECORD))
    policy = _SpyPolicy()
    spec = SpecConfig("speculative", k=4, goodput=False)
    got = Generator(tiny, spec=spec, policy=policy).generate("Give a record.", config=config)
    assert len(policy.seen) == len(got.stats.rounds)
    grammar = got.stats.by_source["grammar"][0]
    assert grammar > 0  # the grammar drafted in some rounds, which the policy did not see
    assert sum(d for d, _ in policy.seen) + grammar <= got.stats.drafted
    assert all(a <= d for d, a in policy.seen)


@pytest.mark.usefixtures("one_thread")
def test_the_cli_drafts_forced_tokens_unless_told_not_to(
    tiny_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a goodput gate (whose trims follow the clock) the rounds are the same on every
    machine: the grammar's tokens, all accepted, raise the tokens per forward."""
    model = ["-m", str(tiny_folder), "--dtype", "float32", "-n", "80", "--regex", RECORD]
    spec = ["--strategy", "speculative", "--drafter", "ngram", "--k", "4", "--no-goodput", "-v"]
    code, plain, _ = run_cli(capsys, ["generate", *model, "Give a record."])
    assert code == 0
    code, forced, err = run_cli(capsys, ["generate", *model, *spec, "Give a record."])
    assert code == 0 and forced == plain
    off = [*spec, "--no-grammar-drafts"]
    code, unforced, err_off = run_cli(capsys, ["generate", *model, *off, "Give a record."])
    assert code == 0 and unforced == plain
    per_forward = [float(re.search(r"([\d.]+)\s+tokens/forward", e)[1]) for e in (err, err_off)]
    assert per_forward[0] > per_forward[1], per_forward


@pytest.mark.usefixtures("one_thread")
def test_constrained_requests_batched_together_each_equal_their_plain_output(
    tiny: LoadedModel,
) -> None:
    """Forced drafts in a continuous batch: every request's own grammar, its own forced tokens,
    the rows allocated together; each output is plain decoding's."""
    prompts = ["Give a record.", "Another record, please.", "A third one.", "And a fourth."]
    config = GenerationConfig(max_new_tokens=80, constraint=Constraint.regex(RECORD))
    plain = Generator(tiny)
    refs = [plain.generate(p, config=config).token_ids for p in prompts]
    for name in ("suffix", "spork"):
        gen = Generator(tiny, spec=SPECS[name])
        results = generate_batch(gen, prompts, config=config, batch=BatchConfig(max_running=4))
        assert [r.token_ids for r in results] == refs, name
        assert sum(r.stats.by_source.get("grammar", [0, 0])[1] for r in results) > 0, name


def test_a_long_forced_literal_is_tokenized_a_prefix_at_a_time(tiny: LoadedModel) -> None:
    """A literal of thousands of bytes (a long constant in a schema) is not tokenized whole
    every round: a prefix of it is, less its last token, which the cut may have split."""
    literal = "".join(f"w{i} " for i in range(700))  # ~3 kB, far over FORCED_BYTES
    state = _state(tiny, re.escape(literal) + "[a-z]")
    assert state.forced(16) == _ids(tiny, literal[:16])
    state.advance(_ids(tiny, literal[:10]))
    assert state.forced(300) == _ids(tiny, literal[10 : 10 + FORCED_BYTES - 1])
    state.advance(_ids(tiny, literal[10:]))
    assert state.forced(16) == []  # the letter after it is open


@pytest.mark.usefixtures("one_thread")
def test_speculation_through_a_long_forced_literal_equals_plain(tiny: LoadedModel) -> None:
    literal = "".join(f"w{i} " for i in range(40))
    config = GenerationConfig(max_new_tokens=200, constraint=Constraint.regex(literal + "[a-z]+"))
    ref = Generator(tiny).generate("Go.", config=config)
    spec = SpecConfig("speculative", k=4, goodput=False)  # no trims by the clock
    got = Generator(tiny, spec=spec).generate("Go.", config=config)
    assert got.token_ids == ref.token_ids and got.text.startswith(literal)
    assert got.stats.target_forwards < ref.stats.target_forwards // 4  # 16 forced a round
