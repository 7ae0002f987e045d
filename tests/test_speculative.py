"""Speculative decoding on the real default model (SmolLM2-135M-Instruct, float32, CPU).

What is checked, in the order of the file:

1. Greedy exactness: every drafter and draft-length policy reproduces plain greedy decoding
   token for token (128 new tokens, EOS ignored). Plain greedy is computed once per prompt.
2. Self-check: the target as its own draft model accepts every draft (acceptance 1.0, mean
   accepted length exactly K + 1). Lost acceptance there means a cache, position or mask bug.
3. Stops inside an accepted block, with an "oracle" drafter (a test double that proposes the
   known plain-greedy continuation, so whole blocks are accepted and a stop can be placed at a
   chosen draft position): EOS and stop ids at draft position 0, in the middle and at the bonus
   token, stop strings inside a draft and across block boundaries, max_new_tokens and the
   context length reached mid-draft, an empty draft, and wrong drafts (rollback); a real
   self-drafter's own cache keeps no rejected token (its drafts equal a fresh drafter's).
4. Sampling: seeded speculative sampling is reproducible, and p == q gives acceptance 1.0.
5. Stats: drafted/accepted/forwards/per-position counters agree with each other (checked on
   every speculative run above, and exactly against what the oracle proposed).

Custom drafters: the oracle tests pass the test double as ``Generator(loaded, spec=...,
drafter=oracle)``; the spec (strategy "speculative", k=K) gives the constant-K policy.

Runtime: every generated token is at least one forward of the 135M model. Plain greedy, n-gram
(constant K) and the draft model run on all 10 prompts; the other drafters and policies run on 1-2
prompts each (see ``EXACT_PLAN``), which keeps the file within a few minutes on two cores.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from itertools import pairwise

import pytest
import torch

from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import Draft, DraftShape, Feedback, chain_draft
from specfork.drafters.model import ModelDrafter
from specfork.engine.generator import GenerationResult, Generator
from specfork.loading.loader import LoadedModel
from specfork.loading.registry import DEFAULT_MODEL
from specfork.models.cost import CostCurve
from specfork.strategies.rate_memory import RateBook

pytestmark = pytest.mark.slow

N_LONG = 128
LONG = GenerationConfig(max_new_tokens=N_LONG, ignore_eos=True)

SUMMARY_SOURCE = (
    "The city council met on Tuesday to discuss the new bike lanes on Main Street. Supporters "
    "said the lanes would make cycling safer and reduce traffic. Shop owners worried that "
    "removing parking spaces would hurt their business. The council agreed to test the lanes "
    "for six months before making a final decision."
)
BUGGY_CODE = (
    "```python\n"
    "def average(numbers):\n"
    "    total = 0\n"
    "    for n in numbers:\n"
    "        total += n\n"
    "    return total / len(numbers) + 1\n"
    "```"
)
PROMPTS = (
    # 0: summarization that repeats its input (the n-gram drafter's best case)
    f"Summarize the following text, reusing its own words:\n\n{SUMMARY_SOURCE}",
    # 1: code from scratch
    "Write a Python function that checks whether a number is prime, with a docstring.",
    # 2: code that repeats its input
    f"Fix the bug in this function and show the corrected code:\n\n{BUGGY_CODE}",
    # 3: creative writing
    "Write a short poem about the sea.",
    # 4: explanation
    "Explain how photosynthesis works to a ten-year-old.",
    # 5: list
    "List five tips for staying productive when working from home.",
    # 6: arithmetic reasoning
    "What is 17 times 23? Explain your calculation step by step.",
    # 7: translation
    "Translate into French: The weather is nice today, so we are going to the beach.",
    # 8: email
    "Write a short email to a colleague asking to move our meeting from Thursday to Friday.",
    # 9: extraction that repeats its input
    'Extract the names and ages as JSON: "Alice is 30 years old, Bob is 25, and Carol is 41."',
)
ALL_PROMPTS = tuple(range(len(PROMPTS)))
FRANCE = "What is the capital of France? Answer in one sentence."  # a short answer, then EOS
ORACLE_PROMPT = 3  # the prompt whose plain-greedy continuation the oracle drafter proposes


def _spec(drafter: str, k: int, **kwargs) -> SpecConfig:
    """A chain strategy without the goodput gate: these tests check what is drafted and
    accepted, so every draft must be verified as drafted (the gate has tests of its own)."""
    return SpecConfig(strategy="speculative", drafter=drafter, k=k, goodput=False, **kwargs)


def _ungated(strategy: str, drafter: str, **kwargs) -> SpecConfig:
    """A DSpark or SPORK strategy without the goodput gate (see `_spec`)."""
    return SpecConfig(strategy, drafter, goodput=False, **kwargs)


DRAFT_MODEL = f"model:{DEFAULT_MODEL}"  # the target itself as a separate draft model
# a CPU-like cost curve for the gated configurations (fixed: their draft lengths then do not
# depend on how fast this machine happens to be)
CURVE = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.25, 1.5, 2.3, 3.9, 6.8))

# name -> (spec, prompts). n-gram with constant K and the draft model run on every prompt. The
# other configurations run on fewer prompts to keep the file within a few minutes on two cores:
# each costs about as much per prompt as plain decoding or more (the self-drafters run 20-30
# layers per drafted token, and layer skipping accepts only ~2-18% of its drafts), and what they
# add over the full runs (a different policy, the target's own layers) shows on any prompt.
EXACT_PLAN: dict[str, tuple[SpecConfig, tuple[int, ...]]] = {
    "ngram-constant-k4": (_spec("ngram", 4), ALL_PROMPTS),
    "ngram-heuristic-k4": (_spec("ngram", 4, k_policy="heuristic"), (1, 3)),
    "ngram-linear-decay-k6": (
        _spec("ngram", 6, k_policy="linear-decay", expected_length=N_LONG),
        (0, 2),
    ),
    "self-layers-0-29-k3": (_spec("self", 3, self_layers="0-29"), (4,)),  # = the whole target
    "self-skip-10-19-k3": (_spec("self", 3, skip_layers="10-19"), (3,)),  # a real subset
    "draft-model-k4": (_spec(DRAFT_MODEL, 4), ALL_PROMPTS),
    # DSpark changes only how much is drafted: the output must still be plain greedy's
    "dspark-ngram": (_ungated("dspark", "ngram"), (0, 2, 4, 6, 8)),
    "dspark-draft-model": (_ungated("dspark", DRAFT_MODEL), (1, 6)),
    "dspark-self-skip-10-19": (
        _ungated("dspark", "self", skip_layers="10-19"),
        (5,),
    ),
    # SPORK: trees verified in one pass, the accepted path compacted in the cache
    "spork-recycle-forks": (_ungated("spork", "recycle"), (1, 3, 5, 7, 9)),
    "spork-recycle-dynamic": (
        _ungated("spork", "recycle", tree="dynamic"),
        (0, 2, 7),
    ),
    "spork-recycle+ngram": (_ungated("spork", "recycle+ngram"), (1, 3, 5)),
    "spork-recycle+self": (
        _ungated("spork", "recycle+self", skip_layers="10-19"),
        (4,),
    ),
    "spork-draft-model-dynamic": (
        _ungated("spork", DRAFT_MODEL, tree="dynamic"),
        (6,),
    ),
    # the goodput gate on (the default): it only shortens drafts, the output stays plain's
    "ngram-goodput": (SpecConfig("speculative", "ngram", k=4), (0, 3, 6, 9)),
    "dspark-goodput": (SpecConfig("dspark", "ngram"), (1, 4)),
    "spork-recycle+ngram-goodput": (SpecConfig("spork", "recycle+ngram"), (2, 5)),
}
IDENTICAL_DRAFTERS = ("self-layers-0-29-k3", "draft-model-k4", "dspark-draft-model")
MODEL_DRAFTERS = (
    "self-layers-0-29-k3",
    "self-skip-10-19-k3",
    "draft-model-k4",
    "dspark-draft-model",
    "dspark-self-skip-10-19",
)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def plain(smollm_f32: LoadedModel) -> Generator:
    return Generator(smollm_f32)


@pytest.fixture(scope="module")
def reference(plain: Generator) -> Callable[[int], GenerationResult]:
    """Plain greedy decoding of PROMPTS[i] (N_LONG tokens, EOS ignored), computed once."""
    done: dict[int, GenerationResult] = {}

    def get(i: int) -> GenerationResult:
        if i not in done:
            done[i] = plain.generate(PROMPTS[i], config=LONG)
            assert len(done[i].token_ids) == N_LONG and done[i].finish_reason == "length"
        return done[i]

    return get


@pytest.fixture(scope="module")
def spec_gen(smollm_f32: LoadedModel) -> Iterator[Callable[[str], Generator]]:
    """The Generator of an EXACT_PLAN configuration, built once (a draft model loads once)."""
    made: dict[str, Generator] = {}

    def get(name: str) -> Generator:
        if name not in made:
            # each request's gate starts afresh: what it drafts depends on its prompt alone,
            # not on which requests this worker happened to run before it
            made[name] = Generator(
                smollm_f32,
                spec=EXACT_PLAN[name][0],
                cost_curve=CURVE,
                rates=RateBook(shared=False),
            )
        return made[name]

    yield get
    made.clear()


class OracleDrafter:
    """A test double of the Drafter protocol that proposes the plain-greedy continuation.

    Until the output has `start` tokens it proposes nothing (each of those rounds emits exactly
    one token), so the first non-empty draft begins at output index `start`: a token at index i
    then sits at draft position i - start. With `wrong_at` = j the draft's token at position j
    is replaced by a different one, so exactly j tokens of every draft are accepted.

    It records what it was asked and what it proposed: `budgets`, `proposals` as (output index of
    the first drafted token, tokens), and `rollbacks` (the lengths the engine kept).
    """

    name = "oracle"
    cost = 0.0
    wants_logits = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self, continuation: list[int], start: int = 1, wrong_at: int | None = None, vocab: int = 1
    ) -> None:
        self.continuation = list(continuation)
        self.start = start
        self.wrong_at = wrong_at
        self.vocab = vocab
        self.prompt_len = 0
        self.budgets: list[int] = []
        self.proposals: list[tuple[int, list[int]]] = []
        self.rollbacks: list[int] = []
        self.diverged = False

    def begin(self, prompt_ids: list[int]) -> None:
        self.prompt_len = len(prompt_ids)
        self.budgets.clear()
        self.proposals.clear()
        self.rollbacks.clear()
        self.diverged = False

    def propose(
        self, history: list[int], shape: DraftShape, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        m = len(history) - self.prompt_len  # output tokens so far
        budget = shape.depth
        self.budgets.append(budget)
        tokens: list[int] = []
        if history[self.prompt_len :] != self.continuation[:m]:
            self.diverged = True  # the output left plain greedy; the test's asserts will say so
        elif m >= self.start:
            tokens = self.continuation[m : m + budget]
            if self.wrong_at is not None and self.wrong_at < len(tokens):
                tokens[self.wrong_at] = (tokens[self.wrong_at] + 1) % self.vocab
        self.proposals.append((m, tokens))
        return chain_draft(torch.tensor(tokens, dtype=torch.long))

    def observe(self, feedback: Feedback) -> None:
        self.rollbacks.append(feedback.committed)


def _oracle_gen(
    loaded: LoadedModel, oracle: OracleDrafter, k: int, max_context: int | None = None
) -> Generator:
    # The constant-K policy comes from the spec; the drafter is the test double.
    return Generator(loaded, spec=_spec("ngram", k), drafter=oracle, max_context=max_context)


# ----------------------------------------------------------------------------- helpers


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _assert_same_ids(got: GenerationResult, want: list[int], what: str = "") -> None:
    i = _first_divergence(got.token_ids, want)
    assert i is None, (
        f"{what}: differs from plain greedy at output token {i} "
        f"(got {got.token_ids[i : i + 5]}, plain {want[i : i + 5]}); {got.stats.summary()}"
    )


def _check_spec_stats(result: GenerationResult, *, all_used: bool = True) -> None:
    """Counters of a speculative run agree with each other.

    With `all_used` (no stop inside a block) every emitted token after the first (which comes
    from the prefill) is an accepted draft token or the one target token of its round.
    """
    s = result.stats
    by_d, by_a = s.drafted_by_position, s.accepted_by_position
    assert len(by_d) == len(by_a)
    tree = any("nodes" in r.extra for r in s.rounds)  # per position = per depth: <= nodes
    assert (sum(by_d) <= s.drafted) if tree else (sum(by_d) == s.drafted)
    assert sum(by_a) == s.accepted
    assert 0 <= s.accepted <= s.drafted
    assert all(0 <= a <= d for a, d in zip(by_a, by_d, strict=True)), (by_a, by_d)
    # A round that drafts (accepts) position j + 1 also drafts (accepts) position j.
    assert all(x >= y for x, y in pairwise(by_d)), by_d
    assert all(x >= y for x, y in pairwise(by_a)), by_a
    assert not by_d or by_d[0] <= s.target_forwards
    assert s.acceptance_rate == (s.accepted / s.drafted if s.drafted else 0.0)
    if all_used:
        assert s.new_tokens - 1 == s.accepted + s.target_forwards, s.to_dict()
    if s.target_forwards:
        assert s.mean_accepted_length == (s.new_tokens - 1) / s.target_forwards


def _rounds(n_new: int, k: int) -> int:
    """Target forwards when every draft of k is accepted: the first token comes from prefill."""
    return math.ceil((n_new - 1) / (k + 1))


# ----------------------------------------------------------------------------- 1. exactness

EXACT_CASES = [(name, i) for name, (_, prompts) in EXACT_PLAN.items() for i in prompts]


@pytest.mark.parametrize(("name", "prompt"), EXACT_CASES)
def test_greedy_exactness(
    name: str,
    prompt: int,
    spec_gen: Callable[[str], Generator],
    reference: Callable[[int], GenerationResult],
) -> None:
    ref = reference(prompt)
    result = spec_gen(name).generate(PROMPTS[prompt], config=LONG)
    _assert_same_ids(result, ref.token_ids, name)
    assert result.text == ref.text
    assert result.finish_reason == "length"
    assert result.prompt_ids == ref.prompt_ids
    s = result.stats
    assert s.new_tokens == N_LONG
    _check_spec_stats(result)
    spec = EXACT_PLAN[name][0]
    k_max = 2 * spec.k if spec.k_policy == "heuristic" else spec.draft_k
    assert len(s.drafted_by_position) <= k_max
    if spec.k_policy == "heuristic":
        assert len(s.drafted_by_position) > spec.k  # K grew after fully accepted drafts
    if spec.strategy == "spork":  # chains from a model cost forwards; recycled forks do not
        model_drafted = "self" in spec.drafter or "model:" in spec.drafter
        assert (s.draft_forwards > 0) == model_drafted, s.to_dict()
    elif name in MODEL_DRAFTERS and spec.strategy == "dspark":
        # one forward per drafted token, and one more where the drafter's own confidence
        # stopped the chain (it computed the next distribution to judge it)
        assert s.draft_forwards >= s.drafted > 0
    elif name in MODEL_DRAFTERS:
        assert s.draft_forwards == s.drafted > 0  # one drafter forward per drafted token
    else:
        assert s.draft_forwards == 0
    if name in IDENTICAL_DRAFTERS and spec.strategy == "dspark":
        assert s.acceptance_rate == 1.0, s.summary()
        ks = [r.k for r in s.rounds]  # confident and always accepted: K climbs to max_k
        assert ks[0] == spec.min_k and spec.max_k in ks and ks == sorted(ks[:-1]) + ks[-1:]
    elif name in IDENTICAL_DRAFTERS:
        assert s.acceptance_rate == 1.0, s.summary()
        assert s.target_forwards == _rounds(N_LONG, spec.k)
    else:
        # Not vacuous: some drafts were accepted and some rejected (then rolled back).
        assert 0 < s.accepted < s.drafted, s.summary()


def test_spork_forks_beyond_the_first_win(
    spec_gen: Callable[[str], Generator], reference: Callable[[int], GenerationResult]
) -> None:
    """Non-first forks win some rounds: their nodes sat among rejected siblings, so the exact
    output after them proves the accepted path was compacted in the cache correctly."""
    result = spec_gen("spork-recycle-forks").generate(PROMPTS[0], config=LONG)
    _assert_same_ids(result, reference(0).token_ids, "spork")
    forks = [r.extra["fork"] for r in result.stats.rounds]
    assert any(f is not None and f > 0 for f in forks), forks
    assert all(r.extra["nodes"] == r.drafted for r in result.stats.rounds)


# ----------------------------------------------------------------------------- 2. self-check

N_SELF = 37  # 36 decoded tokens: a whole number of rounds of K + 1 for K = 1, 3 and 5


@pytest.mark.parametrize("k", [1, 3, 5])
def test_target_as_its_own_draft_model_accepts_everything(
    k: int, smollm_f32: LoadedModel, reference: Callable[[int], GenerationResult]
) -> None:
    assert (N_SELF - 1) % (k + 1) == 0
    gen = Generator(smollm_f32, spec=_spec(DRAFT_MODEL, k))
    config = GenerationConfig(max_new_tokens=N_SELF, ignore_eos=True)
    result = gen.generate(PROMPTS[1], config=config)
    _assert_same_ids(result, reference(1).token_ids[:N_SELF], f"draft model k={k}")
    s = result.stats
    rounds = (N_SELF - 1) // (k + 1)
    assert s.acceptance_rate == 1.0, s.summary()
    assert s.mean_accepted_length == k + 1, s.summary()
    assert s.target_forwards == rounds
    assert s.drafted == s.accepted == s.draft_forwards == rounds * k
    assert s.drafted_by_position == s.accepted_by_position == [rounds] * k
    _check_spec_stats(result)


# ----------------------------------------------------------------------------- 3. stops

K = 4  # draft length of the oracle tests


@pytest.fixture(scope="module")
def oracle_ref(reference: Callable[[int], GenerationResult]) -> GenerationResult:
    return reference(ORACLE_PROMPT)


def _oracle(ref: GenerationResult, loaded: LoadedModel, **kwargs) -> OracleDrafter:
    return OracleDrafter(ref.token_ids, vocab=loaded.config.vocab_size, **kwargs)


def _check_oracle_run(result: GenerationResult, oracle: OracleDrafter, *, all_used: bool) -> None:
    """Every oracle draft was accepted whole, and the stats count exactly what was proposed."""
    assert not oracle.diverged
    s = result.stats
    assert s.drafted == s.accepted == sum(len(t) for _, t in oracle.proposals)
    assert s.draft_forwards == 0
    _check_spec_stats(result, all_used=all_used)


@pytest.fixture(scope="module")
def france(plain: Generator) -> tuple[GenerationResult, int]:
    """Plain greedy of FRANCE with EOS ignored, and the index of its first EOS."""
    ref = plain.generate(FRANCE, config=GenerationConfig(max_new_tokens=24, ignore_eos=True))
    eos = plain.tokenizer.eos_ids
    n = next(i for i, t in enumerate(ref.token_ids) if t in eos)
    assert n >= K, ref.text  # a real answer before the EOS
    return ref, n


@pytest.mark.parametrize("pos", [0, 2, K - 1])
def test_eos_inside_an_accepted_draft(
    pos: int, smollm_f32: LoadedModel, plain: Generator, france: tuple[GenerationResult, int]
) -> None:
    ref, n = france
    oracle = _oracle(ref, smollm_f32, start=n - pos)
    config = GenerationConfig(max_new_tokens=24)
    result = _oracle_gen(smollm_f32, oracle, K).generate(FRANCE, config=config)
    # The EOS really was drafted at `pos`, in the last round.
    assert oracle.proposals[-1] == (n - pos, ref.token_ids[n - pos : n - pos + K])
    expected = plain.generate(FRANCE, config=config)
    assert expected.token_ids == ref.token_ids[:n] and expected.finish_reason == "stop"
    assert result.token_ids == expected.token_ids
    assert result.text == expected.text and "Paris" in result.text
    assert result.finish_reason == "stop"
    assert result.stats.new_tokens == n + 1  # the EOS is consumed, not shown
    _check_oracle_run(result, oracle, all_used=False)


@pytest.mark.parametrize("pos", [0, 2, K - 1, K])  # K: the target's own (bonus) token
def test_stop_token_id_inside_an_accepted_block(
    pos: int, smollm_f32: LoadedModel, oracle_ref: GenerationResult
) -> None:
    ids = oracle_ref.token_ids
    i = next(i for i in range(K + 2, N_LONG) if ids[i] not in ids[:i])  # a first occurrence
    oracle = _oracle(oracle_ref, smollm_f32, start=i - pos)
    config = GenerationConfig(max_new_tokens=N_LONG, ignore_eos=True, stop_token_ids=(ids[i],))
    result = _oracle_gen(smollm_f32, oracle, K).generate(PROMPTS[ORACLE_PROMPT], config=config)
    assert oracle.proposals[-1] == (i - pos, ids[i - pos : i - pos + K])
    assert result.token_ids == ids[:i]
    assert result.finish_reason == "stop"
    assert result.stats.new_tokens == i + 1
    _check_oracle_run(result, oracle, all_used=False)


def _stop_string_at(gen: Generator, ids: list[int], first: int) -> tuple[int, str, int]:
    """A stop string that starts in token a and ends in token a + 1 (a >= first) and occurs
    nowhere earlier in the text: (a, stop, index of the stop in the text)."""
    tok = gen.tokenizer
    text = tok.decode(ids, skip_special_tokens=True)
    for a in range(first, N_LONG - 2):
        upto_a = tok.decode(ids[:a], skip_special_tokens=True)
        with_a = tok.decode(ids[: a + 1], skip_special_tokens=True)
        with_b = tok.decode(ids[: a + 2], skip_special_tokens=True)
        own_a, own_b = with_a[len(upto_a) :], with_b[len(with_a) :]
        if not (with_a.startswith(upto_a) and with_b.startswith(with_a)):
            continue
        if len(own_a) < 2 or not own_b or "\ufffd" in own_a + own_b:
            continue
        stop = own_a[-2:] + own_b[:2]
        if stop.strip() and text.find(stop) == len(with_a) - 2:
            return a, stop, len(with_a) - 2
    raise AssertionError(f"no suitable stop string in {text!r}")


@pytest.mark.parametrize(
    "offset",
    [1, K - 1, K],
    ids=["inside-a-draft", "last-draft-to-bonus", "bonus-to-next-draft"],
)
def test_stop_string_across_draft_boundaries(
    offset: int, smollm_f32: LoadedModel, plain: Generator, oracle_ref: GenerationResult
) -> None:
    """The stop string's first characters come from token a, its last from token a + 1; token a
    sits at position `offset` of a block (K drafted tokens, then the target's bonus token)."""
    ids = oracle_ref.token_ids
    a, stop, cut = _stop_string_at(plain, ids, first=K + 2)
    oracle = _oracle(oracle_ref, smollm_f32, start=a - offset)
    config = GenerationConfig(max_new_tokens=N_LONG, ignore_eos=True, stop=(stop,))
    stream = _oracle_gen(smollm_f32, oracle, K).stream(PROMPTS[ORACLE_PROMPT], config=config)
    deltas = list(stream)
    result = stream.result
    assert result is not None
    assert (a - offset, ids[a - offset : a - offset + K]) in oracle.proposals
    expected = plain.generate(PROMPTS[ORACLE_PROMPT], config=config)
    assert expected.text == oracle_ref.text[:cut]
    assert result.text == expected.text, (stop, result.text)
    assert "".join(deltas) == result.text
    assert result.token_ids == expected.token_ids == ids[: a + 2]
    assert result.finish_reason == expected.finish_reason == "stop"
    _check_oracle_run(result, oracle, all_used=False)


@pytest.mark.parametrize("n", [2, 4, 9, 12])
def test_max_new_tokens_reached_mid_draft(
    n: int, smollm_f32: LoadedModel, oracle_ref: GenerationResult
) -> None:
    oracle = _oracle(oracle_ref, smollm_f32)
    config = GenerationConfig(max_new_tokens=n, ignore_eos=True)
    result = _oracle_gen(smollm_f32, oracle, K).generate(PROMPTS[ORACLE_PROMPT], config=config)
    assert result.finish_reason == "length"
    assert result.token_ids == oracle_ref.token_ids[:n]
    assert result.stats.new_tokens == n
    assert result.stats.target_forwards == _rounds(n, K)
    # The engine shortens the last draft so that the round ends exactly at n tokens; a round
    # with room for only the target's token asks the drafter for nothing.
    expected_budgets, left = [], n - 1
    while left > 0:
        budget = min(K, left - 1)
        if budget:
            expected_budgets.append(budget)
        left -= budget + 1
    assert oracle.budgets == expected_budgets
    _check_oracle_run(result, oracle, all_used=True)


def test_empty_drafts_give_plain_decoding(
    smollm_f32: LoadedModel, oracle_ref: GenerationResult
) -> None:
    n = 24
    oracle = _oracle(oracle_ref, smollm_f32, start=10**9)  # never proposes anything
    config = GenerationConfig(max_new_tokens=n, ignore_eos=True)
    result = _oracle_gen(smollm_f32, oracle, K).generate(PROMPTS[ORACLE_PROMPT], config=config)
    assert result.token_ids == oracle_ref.token_ids[:n]
    assert result.finish_reason == "length"
    s = result.stats
    assert s.target_forwards == s.new_tokens - 1 == n - 1
    assert s.drafted == s.accepted == s.draft_forwards == 0
    assert s.drafted_by_position == s.accepted_by_position == []
    assert s.mean_accepted_length == 1.0
    # The drafter is asked every round except the last, which has room for one token only.
    assert len(oracle.proposals) == n - 2 and all(not t for _, t in oracle.proposals)
    _check_oracle_run(result, oracle, all_used=True)


@pytest.mark.parametrize("drafter", ["oracle", "self"])
@pytest.mark.parametrize("room", [1, K + 2, K + 5])  # new tokens the context leaves room for
def test_context_length_reached_mid_draft(
    drafter: str,
    room: int,
    smollm_f32: LoadedModel,
    plain: Generator,
    oracle_ref: GenerationResult,
) -> None:
    context = len(oracle_ref.prompt_ids) + room
    if drafter == "oracle":
        oracle = _oracle(oracle_ref, smollm_f32)
        gen = _oracle_gen(smollm_f32, oracle, K, max_context=context)
    else:
        gen = Generator(smollm_f32, spec=_spec("self", K, self_layers="0-29"), max_context=context)
    small = Generator(smollm_f32, max_context=context)
    config = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    result = gen.generate(PROMPTS[ORACLE_PROMPT], config=config)
    expected = small.generate(PROMPTS[ORACLE_PROMPT], config=config)
    assert expected.token_ids == oracle_ref.token_ids[:room]
    assert result.token_ids == expected.token_ids
    assert result.finish_reason == expected.finish_reason == "length"
    assert result.stats.target_forwards == _rounds(room, K)
    if drafter == "oracle":
        _check_oracle_run(result, oracle, all_used=True)
    else:
        assert result.stats.acceptance_rate == (1.0 if room > 2 else 0.0)
        _check_spec_stats(result)


@pytest.mark.parametrize("wrong_at", [0, 2])
def test_rejected_drafts_are_rolled_back(
    wrong_at: int, smollm_f32: LoadedModel, oracle_ref: GenerationResult
) -> None:
    """Drafts with a wrong token at `wrong_at`: exactly `wrong_at` tokens of each are accepted,
    the target's cache and the drafter drop the rest, and the output is still plain greedy."""
    n = 30
    oracle = _oracle(oracle_ref, smollm_f32, wrong_at=wrong_at)
    config = GenerationConfig(max_new_tokens=n, ignore_eos=True)
    result = _oracle_gen(smollm_f32, oracle, K).generate(PROMPTS[ORACLE_PROMPT], config=config)
    assert not oracle.diverged
    assert result.token_ids == oracle_ref.token_ids[:n]
    s = result.stats
    accepted = [min(wrong_at, len(t)) for _, t in oracle.proposals]
    assert s.drafted == sum(len(t) for _, t in oracle.proposals)
    assert s.accepted == sum(accepted)
    # Each drafting round emits its accepted tokens and one target token; a last round with
    # room for one token only does not ask the drafter.
    unasked = n - 1 - sum(a + 1 for a in accepted)
    assert unasked in (0, 1)
    assert s.target_forwards == len(oracle.proposals) + unasked
    for j, (d, a) in enumerate(zip(s.drafted_by_position, s.accepted_by_position, strict=True)):
        assert a == (d if j < wrong_at else 0), (s.drafted_by_position, s.accepted_by_position)
    # The drafter is told to keep the committed history plus the accepted draft tokens.
    prompt_len = len(result.prompt_ids)
    kept = [prompt_len + m + a for (m, _), a in zip(oracle.proposals, accepted, strict=True)]
    assert oracle.rollbacks[: len(kept)] == kept
    assert len(oracle.rollbacks) == s.target_forwards
    _check_spec_stats(result)


class RecordingDrafter:
    """Wraps a real drafter and records every request to it: (history, budget, proposal)."""

    def __init__(self, inner: ModelDrafter) -> None:
        self.inner = inner
        self.name = inner.name
        self.cost = inner.cost
        self.wants_logits = inner.wants_logits
        self.hidden_layers = inner.hidden_layers
        self.session: ModelDrafter = inner
        self.prompt: list[int] = []
        self.calls: list[tuple[list[int], int, list[int]]] = []

    def begin(self, prompt_ids: list[int]) -> None:
        self.prompt = list(prompt_ids)
        self.calls.clear()
        self.session = self.inner.begin(prompt_ids)

    def propose(
        self, history: list[int], shape: DraftShape, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        draft = self.session.propose(history, shape, sampling, rng)
        self.calls.append((list(history), shape.depth, draft.tokens.tolist()))
        return draft

    def observe(self, feedback: Feedback) -> None:
        self.session.observe(feedback)


def test_draft_cache_follows_rollbacks(
    smollm_f32: LoadedModel, reference: Callable[[int], GenerationResult]
) -> None:
    """After rejected drafts the self-drafter (layers 10-19 skipped) proposes exactly what a
    fresh drafter proposes for the same history: its own KV cache kept no rejected token."""
    n = 24
    spec = _spec("self", K, skip_layers="10-19")
    inner = Generator(smollm_f32, spec=spec).drafter
    assert isinstance(inner, ModelDrafter)
    recorder = RecordingDrafter(inner)
    gen = Generator(smollm_f32, spec=spec, drafter=recorder)
    config = GenerationConfig(max_new_tokens=n, ignore_eos=True)
    result = gen.generate(PROMPTS[ORACLE_PROMPT], config=config)
    _assert_same_ids(result, reference(ORACLE_PROMPT).token_ids[:n], "self-skip-10-19")
    _check_spec_stats(result)
    # Rounds that follow a partly rejected draft (accepted + 1 < drafted + 1 tokens emitted).
    after_rejection = [
        call
        for prev, call in pairwise(recorder.calls)
        if len(call[0]) - len(prev[0]) - 1 < len(prev[2])
    ]
    assert len(after_rejection) >= 3, result.stats.summary()
    fresh = ModelDrafter(smollm_f32.model, layers=inner.layers, name="fresh")
    rng = torch.Generator().manual_seed(0)
    for history, budget, proposed in after_rejection[:4]:
        session = fresh.begin(recorder.prompt)
        again = session.propose(history, DraftShape(budget), SamplingParams(), rng).tokens.tolist()
        assert again == proposed, (len(history) - len(recorder.prompt), budget)


# ----------------------------------------------------------------------------- 4. sampling

N_SAMPLE = 21  # 20 decoded tokens: 4 rounds of K + 1 = 5


def test_sampling_with_ngram_drafts_is_reproducible(
    spec_gen: Callable[[str], Generator], reference: Callable[[int], GenerationResult]
) -> None:
    gen = spec_gen("ngram-constant-k4")
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True)

    def run(seed: int) -> GenerationResult:
        params = SamplingParams(temperature=0.8, seed=seed)
        return gen.generate(PROMPTS[0], config=config, sampling=params)

    first, again, other = run(7), run(7), run(8)
    assert first.token_ids == again.token_ids and first.text == again.text
    assert len(first.token_ids) == 32
    assert other.token_ids != first.token_ids
    assert first.token_ids != reference(0).token_ids[:32]  # really sampled
    assert first.stats.drafted > 0  # the summary prompt gives the n-gram drafter material
    _check_spec_stats(first)


SEEDED_PLAN = (
    "ngram-goodput",
    "draft-model-k4",
    "dspark-goodput",
    "spork-recycle+ngram-goodput",
    "spork-draft-model-dynamic",
)


@pytest.mark.parametrize("name", SEEDED_PLAN)
def test_seeded_sampling_emits_seeded_plain_decodings_tokens(
    plain: Generator, spec_gen: Callable[[str], Generator], name: str
) -> None:
    """A seeded request draws the token at each position at a uniform keyed by the seed and
    the position (`verify.keyed`): every strategy, gated or not, emits exactly the tokens plain
    decoding emits with the same seed, while its drafts are accepted."""
    gen = spec_gen(name)
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    accepted = 0
    for seed, prompt in ((7, PROMPTS[0]), (8, PROMPTS[2])):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
        want = plain.generate(prompt, config=config, sampling=params)
        got = gen.generate(prompt, config=config, sampling=params)
        assert got.token_ids == want.token_ids, (seed, got.text, want.text)
        accepted += got.stats.accepted
    assert accepted > 0  # the drafts took part


def test_sampling_with_the_target_as_draft_model_accepts_everything(
    spec_gen: Callable[[str], Generator], reference: Callable[[int], GenerationResult]
) -> None:
    """q is the target's own distribution, so p(x) == q(x) and min(1, p/q) = 1 for every draft
    (up to float32 rounding between batched and one-row forwards: ~1e-6 per token)."""
    gen = spec_gen("draft-model-k4")
    config = GenerationConfig(max_new_tokens=N_SAMPLE, ignore_eos=True)
    params = SamplingParams(temperature=0.8, seed=11)
    result = gen.generate(PROMPTS[4], config=config, sampling=params)
    again = gen.generate(PROMPTS[4], config=config, sampling=params)
    assert result.token_ids == again.token_ids
    assert len(result.token_ids) == N_SAMPLE
    assert result.token_ids != reference(4).token_ids[:N_SAMPLE]  # really sampled
    s = result.stats
    assert s.acceptance_rate == 1.0, s.summary()
    assert s.mean_accepted_length == K + 1
    assert s.draft_forwards == s.drafted == 4 * K
    _check_spec_stats(result)
