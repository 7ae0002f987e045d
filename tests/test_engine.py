"""Tests of :class:`specfork.engine.Generator` on the real default model (SmolLM2-135M-Instruct).

The model is loaded once per session in float32 on the CPU (``smollm_f32`` in conftest.py), so
greedy decoding is exactly reproducible. Token counts are kept small: every generated token is a
full forward of the model. The validation tests at the end need no model.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import Draft, DraftShape, Feedback, chain_draft
from specfork.engine.generator import GenerationResult, Generator
from specfork.engine.thread import model_thread, run_in
from specfork.errors import ConfigError, PromptError
from specfork.kernels import load_kernels
from specfork.loading.loader import LoadedModel, load_model
from specfork.strategies.rate_memory import RateBook
from tiny_models import tiny_chat_llama

REPLACEMENT = "\ufffd"
PROMPT = "Write a short poem about the sea."
N_MAIN = 20
JAPANESE = "Say hello in Japanese."  # SmolLM2 answers with characters of two tokens each
FRANCE = "What is the capital of France? Answer in one sentence."  # a short answer, then EOS


@pytest.fixture(scope="module")
def gen(smollm_f32: LoadedModel) -> Generator:
    return Generator(smollm_f32)


@pytest.fixture(scope="module")
def first(gen: Generator) -> GenerationResult:
    """The reference greedy run: N_MAIN tokens of PROMPT (chat template), EOS ignored."""
    return gen.generate(PROMPT, config=GenerationConfig(max_new_tokens=N_MAIN, ignore_eos=True))


def _stream(gen: Generator, prompt, **kwargs) -> tuple[list[str], GenerationResult]:
    stream = gen.stream(prompt, **kwargs)
    deltas = list(stream)
    assert stream.result is not None
    return deltas, stream.result


def _decode(gen: Generator, ids: list[int]) -> str:
    return gen.tokenizer.decode(ids, skip_special_tokens=True)


def _check_stats(result: GenerationResult) -> None:
    s = result.stats
    assert s.prompt_tokens == len(result.prompt_ids)
    # EOS is consumed as a new token but is not part of token_ids.
    eos_stop = result.finish_reason == "stop" and s.new_tokens == len(result.token_ids) + 1
    assert s.new_tokens == len(result.token_ids) or eos_stop
    # The first token comes from the prefill; each later one costs one target forward.
    assert s.target_forwards == s.new_tokens - 1
    assert (s.draft_forwards, s.drafted, s.accepted) == (0, 0, 0)
    assert s.prefill_seconds > 0 and s.prefill_tokens_per_second > 0
    assert s.time_to_first_token >= s.prefill_seconds
    if s.new_tokens > 1:
        assert s.decode_seconds > 0 and s.decode_tokens_per_second > 0
        assert s.mean_accepted_length == 1.0
    assert str(s.new_tokens) in s.summary()


# ----------------------------------------------------------------------------- greedy


@pytest.mark.slow
def test_first_run(first: GenerationResult, smollm_f32: LoadedModel) -> None:
    tok = smollm_f32.tokenizer
    assert first.finish_reason == "length"
    assert len(first.token_ids) == N_MAIN and first.stats.new_tokens == N_MAIN
    assert first.text == tok.decode(first.token_ids, skip_special_tokens=True)
    assert first.text.strip()
    assert first.prompt_ids == tok.encode(
        tok.apply_chat_template([{"role": "user", "content": PROMPT}])
    )
    _check_stats(first)


@pytest.mark.slow
def test_greedy_is_deterministic_and_stream_matches(
    gen: Generator, first: GenerationResult, smollm_f32: LoadedModel
) -> None:
    config = GenerationConfig(max_new_tokens=N_MAIN, ignore_eos=True)
    deltas, streamed = _stream(gen, PROMPT, config=config)
    assert streamed.token_ids == first.token_ids
    assert "".join(deltas) == streamed.text == first.text
    assert all(deltas) and not any(REPLACEMENT in d for d in deltas)
    # A new Generator with a small prefill chunk (several prefill forwards) and the prompt given
    # as token ids gives the same tokens.
    other = Generator(smollm_f32, prefill_chunk=7)
    assert other.generate(first.prompt_ids, config=config).token_ids == first.token_ids


@pytest.mark.slow
def test_stream_never_splits_a_character(gen: Generator) -> None:
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    deltas, result = _stream(gen, JAPANESE, config=config)
    assert "".join(deltas) == result.text
    assert not any(REPLACEMENT in d for d in deltas), deltas
    assert any(ord(c) > 0x3000 for c in result.text), result.text  # really multi-byte text
    assert len(deltas) < len(result.token_ids)  # some characters took two tokens


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 5])
def test_max_new_tokens(gen: Generator, first: GenerationResult, n: int) -> None:
    result = gen.generate(PROMPT, config=GenerationConfig(max_new_tokens=n, ignore_eos=True))
    assert result.finish_reason == "length"
    assert result.token_ids == first.token_ids[:n]
    assert result.stats.new_tokens == n and result.stats.target_forwards == n - 1
    _check_stats(result)


@pytest.mark.slow
def test_abandoned_stream_does_not_disturb_the_next_request(
    gen: Generator, first: GenerationResult
) -> None:
    stream = gen.stream(PROMPT, config=GenerationConfig(max_new_tokens=N_MAIN, ignore_eos=True))
    next(iter(stream))  # stop after the first delta; the cache is left half used
    result = gen.generate(PROMPT, config=GenerationConfig(max_new_tokens=6, ignore_eos=True))
    assert result.token_ids == first.token_ids[:6]


@pytest.mark.slow
def test_stop_string_from_the_middle(gen: Generator, first: GenerationResult) -> None:
    text = first.text
    words = text.split()
    assert len(words) >= 6, text
    stop = " " + words[len(words) // 2]  # a word from the middle, with its leading space
    cut = text.find(stop)
    assert 0 < cut < len(text) - len(stop)
    config = GenerationConfig(max_new_tokens=N_MAIN, ignore_eos=True, stop=(stop,))
    deltas, result = _stream(gen, PROMPT, config=config)
    assert result.text == text[:cut]
    assert "".join(deltas) == result.text
    assert result.finish_reason == "stop"
    n = len(result.token_ids)
    assert n < N_MAIN and result.token_ids == first.token_ids[:n]
    # The last token kept is the one that completed the stop string.
    assert stop not in _decode(gen, first.token_ids[: n - 1])
    assert stop in _decode(gen, first.token_ids[:n])
    assert result.stats.new_tokens == n
    _check_stats(result)


@pytest.mark.slow
def test_eos_stops(gen: Generator, smollm_f32: LoadedModel) -> None:
    eos_ids = smollm_f32.tokenizer.eos_ids
    result = gen.generate(FRANCE, config=GenerationConfig(max_new_tokens=40))
    assert result.finish_reason == "stop"
    assert "Paris" in result.text
    assert not eos_ids & set(result.token_ids)
    assert result.stats.new_tokens == len(result.token_ids) + 1
    _check_stats(result)
    # With ignore_eos the very next token is an EOS id and generation goes on past it.
    n = len(result.token_ids)
    config = GenerationConfig(max_new_tokens=n + 2, ignore_eos=True)
    past = gen.generate(FRANCE, config=config)
    assert past.finish_reason == "length"
    assert past.token_ids[:n] == result.token_ids
    assert past.token_ids[n] in eos_ids
    assert len(past.token_ids) == n + 2
    # An extra stop id ends the output before that token, like EOS.
    config = GenerationConfig(max_new_tokens=n + 2, stop_token_ids=(result.token_ids[2],))
    early = gen.generate(FRANCE, config=config)
    assert early.finish_reason == "stop"
    assert early.token_ids == result.token_ids[:2]


# ----------------------------------------------------------------------------- sampling


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(gen: Generator, first: GenerationResult) -> None:
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True)

    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=seed)
        return gen.generate(PROMPT, config=config, sampling=params).token_ids

    runs = {seed: run(seed) for seed in (0, 1, 2, 3)}
    assert run(0) == runs[0]
    assert run(3) == runs[3]
    assert len({tuple(ids) for ids in runs.values()}) >= 3, runs
    assert any(ids != first.token_ids[:10] for ids in runs.values())  # really sampled


@pytest.mark.slow
def test_tiny_temperature_acts_greedy(gen: Generator, first: GenerationResult) -> None:
    try:
        params = SamplingParams(temperature=1e-40, seed=0)
    except ConfigError:
        return  # rejecting it up front would be fine too
    config = GenerationConfig(max_new_tokens=3, ignore_eos=True)
    assert gen.generate(PROMPT, config=config, sampling=params).token_ids == first.token_ids[:3]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2**64, 2**63, -1])
def test_out_of_range_seed_is_a_config_error(seed: int) -> None:
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
        SamplingParams(temperature=0.8, seed=seed)
    assert SamplingParams(temperature=0.8, seed=2**63 - 1).seed == 2**63 - 1


# ----------------------------------------------------------------------------- prompts


@pytest.mark.slow
def test_chat_messages_with_a_system_message(gen: Generator, smollm_f32: LoadedModel) -> None:
    tok = smollm_f32.tokenizer
    messages = [
        {"role": "system", "content": "You are a pirate. Answer in pirate speak."},
        {"role": "user", "content": "Who are you?"},
    ]
    result = gen.generate(messages, config=GenerationConfig(max_new_tokens=4))
    assert result.prompt_ids == tok.encode(tok.apply_chat_template(messages))
    shown = tok.decode(result.prompt_ids)
    assert "<|im_start|>system\nYou are a pirate. Answer in pirate speak.<|im_end|>" in shown
    assert "named SmolLM" not in shown  # the template's default system message is replaced
    assert shown.endswith("<|im_start|>assistant\n")
    assert 1 <= len(result.token_ids) <= 4
    plain = gen.generate("Who are you?", config=GenerationConfig(max_new_tokens=4))
    assert "named SmolLM" in tok.decode(plain.prompt_ids)
    assert plain.prompt_ids != result.prompt_ids


@pytest.mark.slow
def test_plain_prompt_without_chat(gen: Generator, smollm_f32: LoadedModel) -> None:
    tok = smollm_f32.tokenizer
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    result = gen.generate("Once upon a time", chat=False, config=config)
    assert result.prompt_ids == tok.encode("Once upon a time")
    assert "<|im_start|>" not in tok.decode(result.prompt_ids)
    assert len(result.token_ids) == 4 and result.finish_reason == "length"
    assert gen.encode_prompt("Once upon a time") != result.prompt_ids  # chat is the default
    with pytest.raises(ConfigError, match="chat"):
        gen.generate([{"role": "user", "content": "hi"}], chat=False)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["", "   ", " \n\t ", []])
def test_empty_prompts(gen: Generator, prompt) -> None:
    with pytest.raises(PromptError, match="empty"):
        gen.generate(prompt)
    if isinstance(prompt, str):
        with pytest.raises(PromptError, match="empty"):
            gen.stream(prompt, chat=False)


@pytest.mark.slow
def test_out_of_vocab_prompt_ids(gen: Generator, smollm_f32: LoadedModel) -> None:
    vocab = smollm_f32.config.vocab_size
    for ids in ([1, vocab], [-1, 5]):
        with pytest.raises(PromptError, match=str(vocab)):
            gen.generate(ids)


@pytest.mark.slow
def test_more_messages_than_the_context_holds_are_refused_before_rendering(
    smollm_f32: LoadedModel,
) -> None:
    small = Generator(smollm_f32, max_context=64)
    with pytest.raises(PromptError, match="64 messages cannot fit a context of 64 tokens"):
        small.encode_prompt([{"role": "user", "content": "a"}] * 64)
    with pytest.raises(PromptError, match="context holds 64"):  # rendered, then too long
        small.stream([{"role": "user", "content": "a"}] * 20)
    assert len(small.encode_prompt([{"role": "user", "content": "a"}] * 2)) < 64


@pytest.mark.slow
@pytest.mark.parametrize(
    "prompt", ["hi \udcff", [{"role": "user", "content": "ok \ud800 no"}], "caf\udce9"]
)
def test_text_that_is_not_utf8_is_a_prompt_error(gen: Generator, prompt) -> None:
    """Undecodable bytes (read with surrogateescape, as Python reads argv) and lone surrogates."""
    with pytest.raises(PromptError, match="not valid UTF-8 text"):
        gen.generate(prompt)


@pytest.mark.slow
def test_booleans_are_not_token_ids(gen: Generator) -> None:
    with pytest.raises(PromptError, match=r"prompt element 0 is True \(bool\)"):
        gen.prompt_ids([True, False])
    assert gen.prompt_ids([1, 2, 3]) == [1, 2, 3]


@pytest.mark.slow
def test_load_model_checks_its_arguments() -> None:
    with pytest.raises(ConfigError, match="kernels must be True, False or None"):
        load_model("smollm2-135m-instruct", kernels="off", progress=False)
    with pytest.raises(ConfigError, match="named by a string or a path"):
        load_model(None, progress=False)


@pytest.mark.slow
def test_context_limit(smollm_f32: LoadedModel, gen: Generator) -> None:
    small = Generator(smollm_f32, max_context=64)
    assert small.context == 64
    long_prompt = "Tell me about the history of the city of Paris. " * 10
    assert len(small.encode_prompt(long_prompt)) > 64
    with pytest.raises(PromptError, match=r"context holds 64"):
        small.stream(long_prompt)  # raised at once, before any iteration
    ids = gen.encode_prompt(PROMPT, chat=False)
    filler = small.tokenizer.encode(" the sea", add_special_tokens=False)
    while len(ids) < 64:
        ids += filler
    ids = ids[:64]
    with pytest.raises(PromptError, match="64 tokens"):
        small.generate(ids)
    # The context holds the prompt and the generated tokens: 60 + 4, or 63 + 1.
    for size in (60, 63):
        config = GenerationConfig(max_new_tokens=10, ignore_eos=True)
        result = small.generate(ids[:size], config=config)
        assert len(result.token_ids) == 64 - size, size
        assert result.finish_reason == "length"
        config = GenerationConfig(max_new_tokens=64 - size, ignore_eos=True)
        assert result.token_ids == gen.generate(ids[:size], config=config).token_ids


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
    ],
)
def test_bad_sampling_params(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 0},
        {"max_new_tokens": -3},
        {"max_new_tokens": 2.0},
        {"max_new_tokens": True},
        {"stop": ("",)},
        {"stop": ("ok", 3)},
    ],
)
def test_bad_generation_config(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        GenerationConfig(**kwargs)


def test_good_params_are_accepted() -> None:
    assert SamplingParams().greedy
    params = SamplingParams(temperature=0.8, top_k=40, top_p=1, min_p=1, seed=7)
    assert not params.greedy
    assert GenerationConfig(max_new_tokens=1, stop=("\n",)).max_new_tokens == 1


def test_per_request_strategy(smollm_f32: LoadedModel, first: GenerationResult) -> None:
    """`spec=` runs one request with another strategy; the next plain request is plain again."""
    from specfork.config import SpecConfig
    from specfork.engine.generator import MAX_KEPT_STRATEGIES

    own = Generator(smollm_f32)
    assert own.max_strategies == MAX_KEPT_STRATEGIES
    config = GenerationConfig(max_new_tokens=N_MAIN, ignore_eos=True)
    for k in range(1, MAX_KEPT_STRATEGIES + 3):  # more strategies than are kept
        spec = SpecConfig("speculative", "ngram", k=k)
        result = own.generate(PROMPT, config=config, spec=spec)
        assert result.token_ids == first.token_ids
        assert own.spec == spec
    assert len(own._strategies) == MAX_KEPT_STRATEGIES
    assert own.default_spec in own._strategies  # the default is never forgotten
    again = own.generate(PROMPT, config=config)
    assert again.token_ids == first.token_ids and again.stats.drafted == 0
    with pytest.raises(ConfigError, match="unknown drafter"):
        own.generate(PROMPT, config=config, spec=SpecConfig("speculative", "nope"))


@pytest.mark.parametrize("kernels", [False, True], ids=["eager", "kernels"])
def test_decoding_from_another_thread_warns_once_on_the_eager_path(
    kernels: bool, tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """PyTorch's eager CPU thread pool belongs to the loading thread (specfork.engine.thread);
    the kernels run on threads of their own, from any thread."""
    if kernels and load_kernels() is None:
        pytest.skip("the kernels cannot be built here")
    folder = tiny_chat_llama(tmp_path_factory.mktemp("tiny-thread"))
    gen = Generator(load_model(str(folder), kernels=kernels, progress=False))
    config = GenerationConfig(max_new_tokens=1)
    with caplog.at_level(logging.WARNING, logger="specfork.engine"):
        gen.generate("Hi", config=config)  # the loading thread: no warning
        assert not caplog.records
        with model_thread() as thread:
            for _ in range(2):
                run_in(thread, gen.generate, "Hi", config=config)
    warned = [r.message.split(":")[0] for r in caplog.records]
    assert warned == ([] if kernels else ["this model was loaded in another thread"])


class OldStyleDrafter:
    """A drafter written against the old protocol (rollback instead of observe, no cost)."""

    name = "old"

    def begin(self, prompt_ids: list[int]) -> None:
        return None

    def propose(self, history, budget, sampling, rng):
        raise AssertionError("never called")

    def rollback(self, length: int) -> None:
        return None


def test_a_drafter_missing_protocol_members_is_named(smollm_f32: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="lacks cost, wants_logits, hidden_layers, observe"):
        Generator(smollm_f32, drafter=OldStyleDrafter())


class RepeatLast:
    """The custom drafter of docs/strategies.md: the last token again, shape.depth times."""

    name, cost, wants_logits = "repeat", 0.0, False
    hidden_layers: tuple[int, ...] = ()  # the target's blocks whose outputs feedback carries

    def __init__(self) -> None:
        self.committed: list[int] = []

    def begin(self, prompt_ids: list[int]) -> None:
        self.committed.clear()

    def propose(self, history, shape: DraftShape, sampling, rng) -> Draft:
        return chain_draft(torch.full((shape.depth,), history[-1]), source=self.name)

    def observe(self, feedback: Feedback) -> None:
        self.committed.append(feedback.committed)


def test_a_custom_drafter_plugs_in_and_stays_lossless(gen: Generator, smollm_f32) -> None:
    """The documented toy drafter: greedy output equal to plain decoding, one feedback per
    round whose rollback point is the history the round committed."""
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    prompt = "a a a a a a a a a a a a a a a a"
    plain = gen.generate(prompt, config=config, chat=False)
    drafter = RepeatLast()
    spec_config = SpecConfig("speculative", k=3, goodput=False)
    spec = Generator(smollm_f32, spec=spec_config, drafter=drafter)
    result = spec.generate(prompt, config=config, chat=False)
    assert result.token_ids == plain.token_ids
    assert len(drafter.committed) == result.stats.target_forwards
    prompt_len = len(result.prompt_ids)
    rounds = result.stats.rounds
    # committed = prompt + tokens emitted before the round + the round's accepted drafts
    want = [prompt_len + r.position + r.accepted for r in rounds]
    assert drafter.committed == want
    assert result.stats.accepted > 0  # the repeated tokens were accepted at least once


class HiddenWatcher(RepeatLast):
    """RepeatLast asking for two of the target's blocks, keeping every feedback."""

    hidden_layers = (3, 0)

    def __init__(self) -> None:
        super().__init__()
        self.feedback: list[Feedback] = []

    def observe(self, feedback: Feedback) -> None:
        super().observe(feedback)
        self.feedback.append(feedback)


def test_a_drafter_gets_the_hidden_states_it_asks_for(smollm_f32) -> None:
    """Every feedback (prompt chunks and rounds) carries the chosen blocks' outputs at its
    rows; along the committed history they are the blocks' outputs of one plain forward."""
    drafter = HiddenWatcher()
    spec_config = SpecConfig("speculative", k=3, goodput=False)
    spec = Generator(smollm_f32, spec=spec_config, drafter=drafter, prefill_chunk=8)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    result = spec.generate("b b b b b b b b b b b b", config=config, chat=False)
    model, d = smollm_f32.model, smollm_f32.model.config.hidden_size
    history = result.prompt_ids + result.token_ids
    rows = torch.zeros(2, len(history) - 1, d)  # [C, positions run, D]
    for fb in drafter.feedback:
        assert fb.hidden is not None and fb.hidden.shape == (2, len(fb.tokens), d)
        assert fb.logits is None  # not asked for
        prompt_chunk = fb.committed <= len(result.prompt_ids)
        # a prompt chunk's rows are all final; a round keeps its root and the accepted nodes
        kept = list(range(len(fb.tokens))) if prompt_chunk else [0, *(1 + n for n in fb.path)]
        first = fb.committed - len(kept)
        rows[:, first : fb.committed] = fb.hidden[:, kept]
    assert result.stats.accepted > 0 and len(drafter.feedback) > 2
    with torch.inference_mode():
        _, ref = model.extend_capturing(history[:-1], model.new_cache(64), (3, 0))
    torch.testing.assert_close(rows, ref, atol=2e-4, rtol=1e-4)
    with pytest.raises(ConfigError, match="hidden_layers"):
        bad = HiddenWatcher()
        bad.hidden_layers = (0, 99)
        Generator(smollm_f32, drafter=bad)


def test_the_strategy_cache_keeps_the_most_recent_and_the_default(smollm_f32) -> None:
    from specfork.config import SpecConfig

    own = Generator(smollm_f32, max_strategies=2)
    config = GenerationConfig(max_new_tokens=2, ignore_eos=True)
    specs = [SpecConfig("speculative", "ngram", k=k) for k in (1, 2, 3)]
    for spec in specs:
        own.generate("hi", config=config, spec=spec)
    assert list(own._strategies) == [own.default_spec, specs[2]]
    one = Generator(smollm_f32, max_strategies=1)  # the default and the one in use
    one.generate("hi", config=config, spec=specs[0])
    assert list(one._strategies) == [one.default_spec, specs[0]]
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="max_strategies"):
            Generator(smollm_f32, max_strategies=bad)


@pytest.mark.parametrize(
    "spec",
    [
        SpecConfig(),
        SpecConfig("speculative", "ngram", k=3),
        SpecConfig("dspark", "ngram"),
        SpecConfig("speculative", "self", k=2, skip_layers="10-19"),
        SpecConfig("spork", "recycle+ngram"),
    ],
    ids=["ar", "ngram", "dspark", "self", "spork"],
)
def test_requests_in_flight_together_keep_their_own_state(smollm_f32, spec: SpecConfig) -> None:
    """Two streams of one strategy advanced in turn (each with its own KV cache, drafter state
    and policy state) produce what each produces alone, with the same per-round trace (rows
    priced by a fixed curve, and no rates shared between requests: nothing else couples them)."""
    curve, rates = smollm_f32.model.cost_curve(), RateBook(shared=False)
    own = Generator(smollm_f32, spec=spec, cost_curve=curve, rates=rates)
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    prompts = ["Write a haiku about the sea.", "List three prime numbers and explain why."]
    alone = [own.generate(p, config=config) for p in prompts]
    streams = [own.stream(p, config=config) for p in prompts]
    iterators = [iter(s) for s in streams]
    live = [0, 1]
    while live:  # one step of each live stream in turn
        for i in list(live):
            if next(iterators[i], None) is None:
                live.remove(i)
    for stream, single in zip(streams, alone, strict=True):
        assert stream.result is not None
        assert stream.result.token_ids == single.token_ids
        rounds = [(r.k, r.drafted, r.accepted) for r in stream.result.stats.rounds]
        assert rounds == [(r.k, r.drafted, r.accepted) for r in single.stats.rounds]


class OldStylePolicy:
    """A policy written against the old protocol (reset, next_k)."""

    name = "old"

    def reset(self) -> None:
        return None

    def next_k(self, generated: int) -> int:
        return 3


def test_a_policy_missing_protocol_members_is_named(smollm_f32: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="lacks begin, next_shape, update, trace"):
        Generator(smollm_f32, spec=SpecConfig("speculative"), policy=OldStylePolicy())


@pytest.mark.parametrize(
    "spec",
    [SpecConfig(), SpecConfig("speculative", "ngram", k=4), SpecConfig("spork", "recycle+ngram")],
    ids=["ar", "ngram", "spork"],
)
def test_logprobs_are_the_targets_at_each_emitted_token(smollm_f32, spec: SpecConfig) -> None:
    """One entry per output token (an EOS that ends the output has none): the raw
    log-softmax of the target's logits at that position, as one forward over the whole
    output computes it (eager float32: equal within rounding), top entries sorted."""
    gen = Generator(smollm_f32, spec=spec)
    config = GenerationConfig(max_new_tokens=40, logprobs=3)
    result = gen.generate(FRANCE, config=config)
    assert result.finish_reason == "stop"  # ended by EOS, which gets no entry
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    model = smollm_f32.model
    ids = result.prompt_ids + result.token_ids
    with torch.inference_mode():
        logits = model.extend(ids[:-1], model.new_cache(len(ids) + 8), last_only=False)
    ref = torch.log_softmax(logits[len(result.prompt_ids) - 1 :], dim=-1)  # [T, V]
    assert "".join(e.text for e in result.logprobs) == result.text  # pieces in context
    for i, entry in enumerate(result.logprobs):
        assert entry.token == result.token_ids[i]
        assert entry.logprob == pytest.approx(float(ref[i, entry.token]), abs=1e-4)
        assert entry.top[0] == (entry.token, entry.logprob)  # greedy: the most likely one
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
        assert len(entry.top) == 3
    plain = gen.generate(FRANCE, config=GenerationConfig(max_new_tokens=40))
    assert plain.logprobs is None and plain.token_ids == result.token_ids


def test_a_time_limit_ends_the_output_with_reason_time(smollm_f32) -> None:
    gen = Generator(smollm_f32)
    config = GenerationConfig(max_new_tokens=500, ignore_eos=True, max_seconds=1e-9)
    result = gen.generate(FRANCE, config=config)
    assert result.finish_reason == "time"
    assert 1 <= len(result.token_ids) < 500  # the first token, then the limit is seen
    same_length = GenerationConfig(max_new_tokens=len(result.token_ids), ignore_eos=True)
    full = gen.generate(FRANCE, config=same_length)
    assert full.token_ids == result.token_ids
    for bad in (0, -1, float("nan"), True, "1"):
        with pytest.raises(ConfigError, match="max_seconds"):
            GenerationConfig(max_seconds=bad)
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ConfigError, match="logprobs"):
            GenerationConfig(logprobs=bad)


def test_a_text_far_too_long_for_the_context_is_refused_before_tokenizing(smollm_f32) -> None:
    """No token stands for more characters than the vocabulary's longest token string, so a
    text past 4 × context × that many characters cannot fit: refused without tokenizing it."""
    gen = Generator(smollm_f32, max_context=64)
    too_long = "a" * (4 * 64 * smollm_f32.tokenizer.max_token_chars + 1)
    with pytest.raises(PromptError, match="characters"):
        gen.encode_prompt(too_long, chat=False)
    with pytest.raises(PromptError, match="characters"):
        gen.encode_prompt([{"role": "user", "content": too_long}])
    with pytest.raises(PromptError, match="tokens but the context holds"):  # tokenized: too long
        gen.generate("word " * 200, chat=False)


def test_a_caller_between_deltas_is_not_left_in_inference_mode(smollm_f32) -> None:
    """Inference mode is thread-local: a stream switches it on only while it computes, so
    code between two deltas (or after abandoning a stream) trains and backpropagates."""
    stream = Generator(smollm_f32).stream(FRANCE, config=GenerationConfig(max_new_tokens=8))
    next(iter(stream))
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
    w = torch.ones(2, requires_grad=True)
    (w * 2).sum().backward()
    assert w.grad is not None


def test_a_rounds_time_is_split_by_phase(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every round's phases are timed (GenerationStats.PHASES), the trace records carry their
    milliseconds, and the shares of the decode time add up to one with "other"."""
    from specfork.engine.stats import PHASES

    loaded = load_model(
        str(tiny_chat_llama(tmp_path_factory.mktemp("tiny-phases"))), progress=False
    )
    spec = SpecConfig("spork", "recycle+ngram")
    result = Generator(loaded, spec=spec).generate(
        "1 2 3 1 2 3 1 2 3", config=GenerationConfig(max_new_tokens=16, ignore_eos=True)
    )
    stats = result.stats
    assert set(stats.phase_seconds) == set(PHASES)
    shares = stats.phase_shares()
    assert set(shares) == {*PHASES, "other"} and sum(shares.values()) == pytest.approx(1.0)
    assert stats.phase_seconds["forward"] <= stats.verify_seconds + 1e-9
    for record in stats.rounds:
        assert set(record.extra["ms"]) <= set(PHASES) and record.extra["ms"]["forward"] > 0
    assert "phase_shares" in stats.to_dict()


def test_the_lm_head_counts_as_the_forward(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The logits (the LM head over a round's rows) are the forward's last layer: their time is
    the "forward" phase's, not "other" (a slow LM head shows there, every round)."""
    import time

    loaded = load_model(str(tiny_chat_llama(tmp_path_factory.mktemp("tiny-head"))), progress=False)
    logits = loaded.model.logits

    def slow_logits(hidden: torch.Tensor) -> torch.Tensor:
        time.sleep(0.005)
        return logits(hidden)

    monkeypatch.setattr(loaded.model, "logits", slow_logits)
    stats = (
        Generator(loaded, spec=SpecConfig("ar"))
        .generate("1 2 3", config=GenerationConfig(max_new_tokens=6, ignore_eos=True))
        .stats
    )
    assert stats.phase_seconds["forward"] >= 0.005 * stats.target_forwards
    assert stats.verify_seconds >= 0.005 * stats.target_forwards


def test_drafts_are_counted_by_source(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every drafted and accepted token is counted under its source family, a SPORK tree's
    nodes under the source that proposed them: the counts add up to the run's totals."""
    loaded = load_model(
        str(tiny_chat_llama(tmp_path_factory.mktemp("tiny-sources"))), progress=False
    )
    prompt = "1 2 3 4 1 2 3 4 1 2 3 4 1 2 3"
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    for spec, allowed in [
        (SpecConfig("spork", "recycle+ngram"), {"recycle", "ngram"}),
        (SpecConfig("speculative", "ngram", k=4), {"ngram"}),
    ]:
        stats = Generator(loaded, spec=spec).generate(prompt, config=config).stats
        assert stats.drafted > 0 and set(stats.by_source) <= allowed
        assert sum(d for d, _ in stats.by_source.values()) == stats.drafted
        assert sum(a for _, a in stats.by_source.values()) == stats.accepted
        assert all(a <= d for d, a in stats.by_source.values())
    plain = Generator(loaded).generate(prompt, config=config).stats
    assert plain.by_source == {}
