"""Continuous batching (engine/batch.py): several requests in one forward give each of them
what it gets alone — bitwise rows on the kernels, identical greedy outputs for every strategy,
identical sampled outputs when nothing is trimmed — and the scheduler frees what it holds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import EMPTY_DRAFT, Draft, Feedback
from specfork.drafters.forks import ForkDrafter
from specfork.drafters.recycle import UNKNOWN
from specfork.engine.batch import BatchConfig, Scheduler, generate_batch
from specfork.engine.generator import Generator
from specfork.errors import ConfigError
from specfork.kernels import load_kernels
from specfork.loading.loader import LoadedModel, load_model
from specfork.models.base import Segment
from specfork.models.cost import CostCurve
from specfork.strategies.goodput import EXPLORE_EVERY, allocate, best_length, least_paying_value
from specfork.tree import Tree, tree_mask, tree_positions
from tiny_models import tiny_chat_llama

KERNELS = load_kernels() is not None
CURVE = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.25, 1.5, 2.3, 3.9, 6.8))  # fixed: reproducible
PROMPTS = [
    "the cat sat on the mat and the cat sat on the mat",
    "abc abc abc abc",
    "a much longer prompt that needs several prefill chunks when the step holds few rows",
    "x",
    "one two three one two three one two",
]
STRATEGIES = {
    "ar": SpecConfig(),
    "ngram": SpecConfig("speculative", "ngram", k=4),
    "dspark": SpecConfig("dspark", "ngram"),
    "spork": SpecConfig("spork", "recycle+ngram"),
    "self": SpecConfig("speculative", "self", skip_layers="1", k=2),
}
PATHS = ["eager", "kernels"] if KERNELS else ["eager"]


@pytest.fixture(scope="module", params=PATHS)
def loaded(request: pytest.FixtureRequest, tmp_path_factory, one_thread) -> LoadedModel:
    folder = tiny_chat_llama(tmp_path_factory.mktemp("tiny"), chat=False, seed=3)
    kernels = request.param == "kernels"
    return load_model(str(folder), dtype="float32", kernels=kernels, progress=False)


def _generator(loaded: LoadedModel, spec: SpecConfig) -> Generator:
    return Generator(loaded, spec=spec, cost_curve=CURVE)


def test_forward_batch_rows_equal_alone(loaded: LoadedModel) -> None:
    """A chain, a tree and a single row, each with its own cache, in one forward: hidden
    states and captured blocks equal those of three separate forwards."""
    model = loaded.model
    prefixes = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    tree = Tree(torch.tensor([20, 21, 22]), torch.tensor([-1, 0, 0]))
    rows = [[30, 31, 32], [40, *tree.tokens.tolist()], [50]]
    masks = [None, tree_mask(tree), None]
    alone, batched = [], []
    with torch.inference_mode():
        for prefix, row, mask in zip(prefixes, rows, masks, strict=True):
            one, two = model.new_cache(32), model.new_cache(32)
            model.extend(prefix, one)
            model.extend(prefix, two)
            start = one.length
            pos = (
                torch.arange(start, start + len(row))
                if mask is None
                else tree_positions(tree, start)
            )
            alone.append(
                model.forward_capturing(torch.tensor(row)[None], pos, one, mask, capture=(0, 1))
            )
            batched.append(Segment(torch.tensor(row), pos, two, mask))
        hidden, captured = model.forward_batch(batched, capture=(0, 1))
    expected = torch.cat([h[0] for h, _ in alone])  # [T, D]
    assert hidden.shape == expected.shape
    if model.batch_invariant:
        assert torch.equal(hidden, expected)
        assert torch.equal(captured, torch.cat([c for _, c in alone], dim=1))
    else:
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    assert [s.cache.length for s in batched] == [7, 6, 7]


def test_forward_batch_refuses_a_shared_cache(loaded: LoadedModel) -> None:
    cache = loaded.model.new_cache(16)
    seg = Segment(torch.tensor([1, 2]), torch.arange(2), cache)
    with pytest.raises(ValueError, match="share a cache"):
        loaded.model.forward_batch([seg, Segment(torch.tensor([3]), torch.arange(1), cache)])
    with pytest.raises(ValueError, match="tokens and positions"):
        Segment(torch.tensor([1, 2]), torch.arange(3), cache)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_batch_greedy_equals_alone(loaded: LoadedModel, name: str) -> None:
    """Two running at most (requests join as others finish), eight rows a step (long prompts
    are prefilled in chunks beside decoding requests): every output equals its lone run."""
    gen = _generator(loaded, STRATEGIES[name])
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    alone = [gen.generate(p, config=config) for p in PROMPTS]
    batch = BatchConfig(max_running=2, step_rows=8)
    together = generate_batch(gen, PROMPTS, config=config, batch=batch)
    for a, b in zip(alone, together, strict=True):
        assert b.token_ids == a.token_ids
        assert b.text == a.text and b.finish_reason == a.finish_reason == "length"
        assert b.stats.new_tokens == 24 and b.stats.prompt_tokens == a.stats.prompt_tokens


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_seeded_sampling_in_a_batch_emits_plain_decodings_tokens(
    loaded: LoadedModel, name: str
) -> None:
    """A seeded request's token at each position is drawn at a uniform keyed by the seed and
    the position: alone or in a batch whose allocation trims its drafts, every strategy emits
    the tokens of seeded plain decoding alone."""
    plain, gen = _generator(loaded, STRATEGIES["ar"]), _generator(loaded, STRATEGIES[name])
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    for seed in (11, 12):
        sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
        want = [plain.generate(p, config=config, sampling=sampling).token_ids for p in PROMPTS]
        alone = [gen.generate(p, config=config, sampling=sampling).token_ids for p in PROMPTS]
        batch = BatchConfig(max_running=5, step_rows=64)
        together = generate_batch(gen, PROMPTS, config=config, sampling=sampling, batch=batch)
        assert alone == want
        assert [r.token_ids for r in together] == want


def test_allocation_alone_matches_the_gate_and_shrinks_in_a_full_batch() -> None:
    rates = [0.9, 0.8, 0.6, 0.5]
    values, p = [], 1.0
    for a in rates:
        p *= a
        values.append(p)
    assert allocate([values], 1, CURVE) == [best_length(rates, CURVE)]
    assert allocate([values], 1, CURVE)[0] >= 3
    full = allocate([values] * 16, 16, CURVE)
    assert sum(full) < 16 * 3  # a full batch verifies far fewer draft rows
    assert allocate([[0.1, 0.05]] * 16, 16, CURVE) == [0] * 16  # unlikely drafts: none
    assert allocate([[], [0.99]], 2, CURVE) == [0, 1]


def test_the_least_paying_value_bounds_what_the_allocation_keeps() -> None:
    """θ: nodes all worth a little less keep nothing; a batch of them worth a little more than
    θ at the n that sets it keeps some. Alone θ is the price of a verification row."""
    alone = least_paying_value(1, 1, CURVE, 8)
    assert alone == pytest.approx(min((CURVE(1 + n) - 1) / n for n in range(1, 9)))
    full = least_paying_value(16, 16, CURVE, 16)
    assert full > 0.5 > alone
    below = [[full * 0.99] * 4] * 16
    assert allocate(below, 16, CURVE) == [0] * 16
    above = [[min(1.0, full * 1.05)] * 4] * 16
    assert sum(allocate(above, 16, CURVE)) > 0


def test_prompt_rows_are_sunk_cost_for_the_allocation() -> None:
    """Beside a 100-row prompt chunk (sunk: it runs whatever is drafted), a decoding request's
    rows are charged what they add to the forward: on the curve's linear stretch a draft node
    then pays only if surer than its root, so likely nodes kept when the whole forward is
    charged to the tokens are dropped — and θ says so before any proposal is made."""
    likely = [[0.6, 0.36]]
    assert allocate(likely, 101, CURVE) == [2]  # the step's cost charged to its one token
    assert allocate(likely, 101, CURVE, sunk_rows=100) == [0]
    assert allocate(likely, 1, CURVE, sunk_rows=0) == allocate(likely, 1, CURVE)
    assert least_paying_value(1, 101, CURVE, 8) < 0.2
    assert least_paying_value(1, 101, CURVE, 8, 100) == pytest.approx(1.0)
    flat = CostCurve((1, 2, 4), (1.0, 1.0, 1.0))  # rows that cost nothing more: all kept
    assert allocate([[0.5, 0.2]], 3, flat, sunk_rows=2) == [2]


def test_a_request_drafts_nothing_beside_a_prompt_chunk(loaded: LoadedModel) -> None:
    """A decoding request that drafts alone (its output falls into a loop the n-gram drafter
    predicts) drafts nothing in the steps that also prefill another request's prompt; both
    outputs stay those of lone runs."""
    gen = Generator(loaded, spec=STRATEGIES["ngram"], cost_curve=CURVE, prefill_chunk=16)
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    scheduler = Scheduler(gen, BatchConfig(max_running=2, step_rows=24))
    first = scheduler.add(PROMPTS[0], config=config)
    drafted = 0
    for _ in range(20):
        scheduler.step()
        drafted += scheduler.last_step().draft_rows
    assert drafted > 0 and first in scheduler.running  # alone it drafts
    long_prompt = " ".join([PROMPTS[2]] * 4)
    second = scheduler.add(long_prompt, config=config)
    texts: dict[int, list[int]] = {}
    beside = []
    while scheduler.running:
        prefilling = second.prefilling
        for update in scheduler.step():
            if update.result is not None:
                texts[id(update.running)] = update.result.token_ids
        if prefilling and first in scheduler.running:
            beside.append(scheduler.last_step())
    assert len(beside) >= 2 and all(r.prefill_rows for r in beside)
    assert not any(r.draft_rows for r in beside)
    assert texts[id(first)] == gen.generate(PROMPTS[0], config=config).token_ids
    assert texts[id(second)] == gen.generate(long_prompt, config=config).token_ids


def test_the_sunk_prompt_rows_are_the_rows_the_step_prefills(loaded: LoadedModel) -> None:
    """The rows the allocation counts as sunk are the prompt rows the step runs: one prefill
    chunk per prefilling request, not every prompt token left up to the row budget."""
    gen = Generator(loaded, cost_curve=CURVE, prefill_chunk=16)
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    scheduler = Scheduler(gen, BatchConfig(max_running=3, step_rows=64))
    long_prompt = " ".join([PROMPTS[2]] * 4)  # ~80 tokens: several chunks
    for _ in range(2):
        scheduler.add(long_prompt, config=config)
    estimates = []
    while any(r.prefilling for r in scheduler.running) or not estimates:
        budget = 64 - sum(not r.prefilling for r in scheduler.running)
        estimates.append(scheduler._prompt_rows(budget))
        scheduler.step()
        assert scheduler.last_step().prefill_rows == estimates[-1]
    assert estimates[0] == 32  # two chunks of 16 (all the prompt left, up to 63 rows: 63)


def test_a_full_batch_skips_proposals_that_cannot_pay_and_still_explores(
    loaded: LoadedModel,
) -> None:
    """With verification rows dear (a steep cost curve) and n-gram chains that are rarely
    accepted, requests stop proposing, except one step in EXPLORE_EVERY; their outputs stay
    those of lone runs."""
    steep = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 2.0, 4.0, 8.0, 16.0, 32.0))
    gen = Generator(loaded, spec=STRATEGIES["ngram"], cost_curve=steep)
    config = GenerationConfig(max_new_tokens=3 * EXPLORE_EVERY, ignore_eos=True)
    scheduler = Scheduler(gen, BatchConfig(max_running=8, step_rows=64))
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS[:4]]
    runs = [scheduler.add(p, config=config) for p in prompts]
    results: dict[int, list[int]] = {}
    idle_seen = 0
    while scheduler.running:
        for update in scheduler.step():
            if update.result is not None:
                results[id(update.running)] = update.result.token_ids
        idle_seen = max([idle_seen, *(r.idle for r in scheduler.running)])
    assert idle_seen >= EXPLORE_EVERY - 1  # skipped, then explored (idle never reaches 16)
    for running, prompt in zip(runs, prompts, strict=True):
        assert results[id(running)] == gen.generate(prompt, config=config).token_ids
    assert any(r.req.gate.stats.trials for r in runs)  # exploring drafts teach the rates


def test_the_allocation_counts_whole_drafts_as_fixed_tokens() -> None:
    """Tokens expected from rows outside the allocation raise the bar a node must clear: a
    node worth keeping alone is dropped when the forward already earns many tokens."""
    assert allocate([[0.6]], 1, CURVE) == [1]
    assert allocate([[0.6]], 9, CURVE, fixed_tokens=8.0) == [0]
    same = allocate([[0.6]] + [[]] * 8, 9, CURVE)  # eight empty drafts: eight fixed tokens
    assert allocate([[0.6]], 9, CURVE, fixed_tokens=8.0) == same[:1]


def test_ungated_requests_verify_their_drafts_whole_in_a_batch(loaded: LoadedModel) -> None:
    """A request with `goodput=False` verifies every draft as drafted, however dear the rows:
    its rounds in a full batch are those of its lone run; gated requests beside it are still
    trimmed by the allocation, and every output stays the lone run's."""
    steep = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 2.0, 4.0, 8.0, 16.0, 32.0))
    ungated = dataclasses.replace(STRATEGIES["ngram"], goodput=False)
    gen = Generator(loaded, spec=ungated, cost_curve=steep)
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    scheduler = Scheduler(gen, BatchConfig(max_running=8, step_rows=64))
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS[:4]]
    specs = [ungated if i % 2 == 0 else STRATEGIES["ngram"] for i in range(len(prompts))]
    runs = [scheduler.add(p, config=config, spec=s) for p, s in zip(prompts, specs, strict=True)]
    results = {}
    while scheduler.running:
        for update in scheduler.step():
            if update.result is not None:
                results[id(update.running)] = update.result
    for running, prompt, spec in zip(runs, prompts, specs, strict=True):
        alone = gen.generate(prompt, config=config, spec=spec)
        assert results[id(running)].token_ids == alone.token_ids
        if not spec.goodput:
            drafted = [r.drafted for r in results[id(running)].stats.rounds]
            assert drafted == [r.drafted for r in alone.stats.rounds]
    ungated_rows = sum(
        r.drafted for i, run in enumerate(runs) if i % 2 == 0 for r in results[id(run)].stats.rounds
    )
    assert ungated_rows > 0  # the repetitive prompts draft


class _CountingCurve(CostCurve):
    """CURVE, counting how often it is asked (a model's own curve is measured by forwards)."""

    def __init__(self) -> None:
        super().__init__(CURVE.rows, CURVE.cost)
        object.__setattr__(self, "calls", 0)

    def __call__(self, r: int) -> float:
        object.__setattr__(self, "calls", self.calls + 1)
        return super().__call__(r)


def test_plain_decoding_in_a_batch_never_prices_rows(loaded: LoadedModel) -> None:
    """Without a drafter there is nothing to allocate: a batch of plain requests never asks
    the cost curve (measuring a model's own curve takes seconds on the eager path)."""
    curve = _CountingCurve()
    gen = Generator(loaded, spec=STRATEGIES["ar"], cost_curve=curve)
    scheduler = Scheduler(gen, BatchConfig(max_running=4, step_rows=64))
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    for prompt in PROMPTS[:4]:
        scheduler.add(prompt, config=config)
    while scheduler.running:
        scheduler.step()
    assert curve.calls == 0


def test_a_drafting_batch_prices_rows_once_not_every_step(loaded: LoadedModel) -> None:
    """The least paying value θ looks at every row count up to the step's budget: a batch
    that drafts asks it every step, so it is computed once per (roots, rows, budget), not
    re-read from the curve each step (130 evaluations, ~13% of a lone request's step)."""
    least_paying_value.cache_clear()
    curve = _CountingCurve()
    gen = Generator(loaded, spec=STRATEGIES["ngram"], cost_curve=curve)
    scheduler = Scheduler(gen, BatchConfig(max_running=2, step_rows=64))
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    scheduler.add("abc abc abc abc abc", config=config)
    while scheduler.running:
        scheduler.step()
    steps = len(scheduler.steps)
    assert steps >= 10
    assert curve.calls < 2 * 65 + 8 * steps  # re-pricing every step: > 64 calls a step


def test_lone_requests_run_as_alone_and_the_step_trace_counts_rows(loaded: LoadedModel) -> None:
    gen = _generator(loaded, STRATEGIES["ngram"])
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    scheduler = Scheduler(gen, BatchConfig(max_running=4))
    running = scheduler.add("abc abc abc abc", config=config)
    results = []
    while scheduler.running:
        results += [u.result for u in scheduler.step() if u.result is not None]
    assert results[0].token_ids == gen.generate("abc abc abc abc", config=config).token_ids
    assert running.finished
    steps = list(scheduler.steps)
    assert steps[0].prefill_rows == results[0].stats.prompt_tokens
    assert sum(s.draft_rows for s in steps) == sum(r.drafted for r in results[0].stats.rounds)
    assert steps[0].rows == steps[0].prefill_rows  # the prompt alone in the first step
    assert all(s.rows == 1 + s.draft_rows for s in steps[1:])  # then the root and its draft
    assert sum(s.accepted for s in steps) == sum(r.accepted for r in results[0].stats.rounds)


def test_cancel_frees_the_request_at_once(loaded: LoadedModel) -> None:
    gen = _generator(loaded, STRATEGIES["ar"])
    scheduler = Scheduler(gen, BatchConfig(max_running=2))
    config = GenerationConfig(max_new_tokens=50, ignore_eos=True)
    first = scheduler.add("one two three", config=config)
    second = scheduler.add("four five six", config=config)
    scheduler.step()
    scheduler.step()
    scheduler.cancel(first)
    assert scheduler.running == [second] and first.finished
    assert first.req.out.finish_reason == "cancelled"
    updates = scheduler.step()
    assert [u.running for u in updates] == [second]
    assert scheduler.has_room()


def test_memory_stays_bounded_over_a_thousand_requests(loaded: LoadedModel) -> None:
    """1,000 short requests through four slots: nothing stays running, and the caches are
    reused (a handful ever made, the free list bounded)."""
    gen = _generator(loaded, STRATEGIES["ngram"])
    config = GenerationConfig(max_new_tokens=2, ignore_eos=True)
    scheduler = Scheduler(gen, BatchConfig(max_running=4))
    caches: set[int] = set()
    done, submitted = 0, 0
    while done < 1000:
        while submitted < 1000 and scheduler.has_room():
            running = scheduler.add(f"request {submitted % 7}", config=config)
            caches.add(id(running.req.cache))
            submitted += 1
        done += sum(u.result is not None for u in scheduler.step())
    assert not scheduler.running
    assert len(caches) <= 8
    assert len(gen._free_caches) <= 4


def test_kv_budget_holds_requests_back(loaded: LoadedModel) -> None:
    gen = _generator(loaded, STRATEGIES["ar"])
    config = GenerationConfig(max_new_tokens=8)
    scheduler = Scheduler(gen, BatchConfig(max_running=4))
    scheduler.add("hello", config=config)
    per_request = scheduler.kv_bytes()
    tight = Scheduler(gen, BatchConfig(max_running=4, kv_budget_bytes=per_request))
    assert tight.has_room(5, 8)  # a lone request always runs
    tight.add("hello", config=config)
    assert not tight.has_room(5, 8)
    assert scheduler.has_room(5, 8)


def test_bad_batch_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="max_running must be an integer >= 1"):
        BatchConfig(max_running=0)
    with pytest.raises(ConfigError, match="step_rows"):
        BatchConfig(max_running=8, step_rows=4)
    with pytest.raises(ConfigError, match="kv_budget_bytes"):
        BatchConfig(kv_budget_bytes=-1)


def test_a_bad_prompt_fails_before_anything_runs(loaded: LoadedModel) -> None:
    gen = _generator(loaded, STRATEGIES["ar"])
    with pytest.raises(Exception, match="empty"):
        generate_batch(gen, ["fine", "   "], config=GenerationConfig(max_new_tokens=2))


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"prompts": "hello"}, "prompts must be a list"),
        ({"sampling": [{"temperature": 0.5}]}, "sampling must be a SamplingParams"),
        ({"batch": {"max_running": 2}}, "batch must be a BatchConfig"),
    ],
)
def test_generate_batch_refuses_wrong_types(loaded: LoadedModel, kwargs: dict, words: str) -> None:
    """A string is not run as one prompt per letter; dicts are not taken for settings."""
    args = {"prompts": ["ab"], **kwargs}
    with pytest.raises(ConfigError, match=words):
        generate_batch(Generator(loaded), args.pop("prompts"), chat=False, **args)


def _prefill(
    loaded: LoadedModel, drafter: object, ids: list[int], chunk: int, batched: bool
) -> None:
    """Run `ids` in prompt chunks of `chunk` rows for `drafter` (one new token), alone or
    through the batch scheduler."""
    gen = Generator(loaded, drafter=drafter, prefill_chunk=chunk, cost_curve=CURVE)
    config = GenerationConfig(max_new_tokens=1, ignore_eos=True)
    if batched:
        batch = BatchConfig(max_running=1, step_rows=chunk)
        generate_batch(gen, [ids], config=config, batch=batch)
    else:
        gen.generate(ids, config=config)


@pytest.mark.parametrize("batched", [False, True])
def test_a_prompt_teaches_the_recycle_table_what_followed_each_tokens_last_occurrence(
    loaded: LoadedModel, batched: bool
) -> None:
    """Prefill computes logits only at each distinct token's newest row (in chunks, alone and
    in a batch); the recycle table learns what every prompt row's logits would have taught it:
    row v = the target's top successors after v's last occurrence in the prompt."""
    model, vocab = loaded.model, loaded.config.vocab_size
    ids = [7, 3, 9, 3, 7, 11, 3, 5, 9, 7, 2, 3]  # repeats within and across chunks of 4
    drafter = ForkDrafter(vocab, recycle=True, chains={}, persist=True)
    _prefill(loaded, drafter, ids, chunk=4, batched=batched)
    with torch.inference_mode():
        every, _ = model.extend_capturing(ids, model.new_cache(len(ids)), ())  # [T, V]
    width = drafter.table.width
    for token in set(ids):
        last = max(i for i, t in enumerate(ids) if t == token)
        learned = drafter.table.table[token].long()  # [W]
        best = every[last].topk(width).values  # [W]
        torch.testing.assert_close(every[last][learned], best, rtol=0, atol=1e-5)
    assert (drafter.table.table[[1, 4, 6]] == UNKNOWN).all()  # tokens not in the prompt


class _LogitRecorder:
    """A drafter that drafts nothing and records which prompt rows' logits it was given."""

    name, cost, wants_logits, hidden_layers = "recorder", 0.0, True, ()

    def __init__(self) -> None:
        self.seen: list[tuple[list[int], list[int], int]] = []  # (chunk, rows, logits rows)

    def begin(self, prompt_ids: list[int]) -> None:
        return None

    def propose(self, history, shape, sampling, rng) -> Draft:
        return EMPTY_DRAFT

    def observe(self, feedback: Feedback) -> None:
        if feedback.prompt:
            rows = feedback.logit_rows.tolist()
            self.seen.append((feedback.tokens.tolist(), rows, feedback.logits.shape[0]))


@pytest.mark.parametrize("batched", [False, True])
def test_prefill_computes_logits_only_at_each_tokens_newest_row(
    loaded: LoadedModel, batched: bool
) -> None:
    ids = [7, 3, 9, 3, 7, 11, 3, 5, 9, 9]
    recorder = _LogitRecorder()
    _prefill(loaded, recorder, ids, chunk=5, batched=batched)
    assert recorder.seen == [([7, 3, 9, 3, 7], [2, 3, 4], 3), ([11, 3, 5, 9, 9], [0, 1, 2, 4], 4)]
