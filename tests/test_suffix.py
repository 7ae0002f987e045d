"""The suffix drafter (`--drafter suffix`, SuffixDecoding): its shared index (matches,
frequencies, scores, tree shapes, the token budget and its eviction order, many threads at
once, snapshots), its drafts (exact greedy output in every strategy, the target's distribution
when sampling), requests learning from earlier ones, the bench's per-turn reset, CLI errors."""

from __future__ import annotations

import gc
import random
import re
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cli_run import run_cli
from distribution import goodness_of_fit
from specfork.bench import isolation
from specfork.bench.isolation import TurnReset
from specfork.bench.prompts import BenchPrompt
from specfork.bench.records import PreparedPrompt
from specfork.bench.runner import BenchSettings, run_benchmark
from specfork.bench.specs import parse_strategies
from specfork.cli import build_parser
from specfork.cli.common import resolve_strategy, spec_from_args
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import DraftShape, Feedback
from specfork.drafters.stores import DraftStores
from specfork.drafters.suffix import SuffixDrafter, SuffixSettings
from specfork.drafters.suffix_file import index_file, load_index, save_index
from specfork.drafters.suffix_index import Proposal, SuffixIndex, SuffixLimits
from specfork.drafters.suffix_local import LocalMatch, LocalMatches
from specfork.drafters.suffix_nodes import NONE, ROOT, Nodes
from specfork.engine.batch import generate_batch
from specfork.engine.generator import Generator
from specfork.errors import ConfigError
from specfork.loading.loader import LoadedModel, load_model
from specfork.models.cost import CostCurve
from specfork.sampling import probabilities, sample
from specfork.spec_schema import spec_with
from specfork.verify import verify_sampling
from tiny_models import tiny_chat_llama


def _propose(index: SuffixIndex, context: list[int], *, chain: bool, **kw) -> Proposal:
    args = dict(max_match=8, max_nodes=16, max_depth=8, spec_factor=4.0, min_prob=0.0)
    return index.propose(context, chain=chain, **(args | kw))


def _substrings(sequences: list[list[int]], depth: int) -> Counter:
    """Every substring of at most `depth` tokens, with its number of occurrences."""
    found: Counter = Counter()
    for seq in sequences:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                found[tuple(seq[i:j])] += 1
    return found


def _assert_exact(index: SuffixIndex) -> None:
    """The trie holds exactly the substrings of the kept sequences, with their counts."""
    want = _substrings(index.sequences(), index.limits.depth)
    assert index.nodes() == len(want)
    assert all(index.count(list(s)) == n for s, n in want.items())
    assert index.tokens == sum(len(s) for s in index.sequences()) <= index.limits.max_tokens


# ------------------------------------------------------------------------------ 1. the index


def test_counts_matches_and_most_frequent_continuation() -> None:
    index = SuffixIndex(SuffixLimits(depth=6))
    index.open([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9])
    assert index.count([1, 2, 3]) == 3 and index.count([1, 2, 3, 4]) == 2
    assert index.count([2, 3, 5]) == 1 and index.count([7]) == 0
    chain = _propose(index, [8, 1, 2, 3], chain=True)
    assert chain.match == 3  # "8 1 2 3" never occurred, "1 2 3" did (followed by 4 twice, 5 once)
    assert chain.tokens == [4, 1, 2] and chain.parents == [-1, 0, 1]
    assert chain.scores == pytest.approx([2 / 3, 2 / 3 * 1 / 2, 2 / 3 * 1 / 2])  # "4" → 1 or 9


def test_a_tree_branches_where_earlier_text_went_on_differently() -> None:
    index = SuffixIndex(SuffixLimits(depth=8))
    index.open([5, 6, 7, 1, 1, 5, 6, 7, 1, 1, 5, 6, 7, 2, 2])
    tree = _propose(index, [0, 5, 6, 7], chain=False, max_nodes=4, max_depth=3)
    assert tree.match == 3
    # best-first: "1 1 5" (2/3 each) before the other branch "2" (1/3)
    assert tree.tokens == [1, 1, 5, 2] and tree.parents == [-1, 0, 1, -1]
    assert tree.scores == pytest.approx([2 / 3, 2 / 3, 2 / 3, 1 / 3])
    assert all(tree.scores[i] <= tree.scores[p] for i, p in enumerate(tree.parents) if p >= 0)


def test_a_longer_match_drafts_deeper_and_min_prob_cuts() -> None:
    index = SuffixIndex(SuffixLimits(depth=12))
    index.open([*range(10), 50, *range(10)])
    one = _propose(index, [9, 3], chain=True, spec_factor=1.0)
    four = _propose(index, [0, 1, 2, 3], chain=True, spec_factor=1.0)
    assert (one.match, one.tokens) == (1, [4])  # ⌈1 · 1⌉ token for a match of one
    assert (four.match, four.tokens) == (4, [4, 5, 6, 7])
    index.open([1, 2, 8])
    cut = _propose(index, [1, 2], chain=True, min_prob=0.5, spec_factor=2.0)
    assert cut.tokens == [3, 4, 5, 6]  # "1 2" → 3 (2 of 3): 2/3 ≥ 0.5
    assert _propose(index, [1, 2], chain=True, min_prob=0.7).tokens == []
    assert _propose(index, [77], chain=True).match == 0  # no match: nothing


def test_the_own_end_of_a_sequence_is_no_match() -> None:
    index = SuffixIndex()
    index.open([1, 2, 3])
    assert _propose(index, [1, 2, 3], chain=True).tokens == []  # only itself, nothing after
    assert _propose(index, [1, 2], chain=True).tokens == [3]


def test_the_budget_holds_under_many_inserts_and_counts_stay_exact() -> None:
    rng = random.Random(0)
    index = SuffixIndex(SuffixLimits(max_tokens=300, depth=7))
    for _ in range(60):
        seq = index.open([rng.randrange(12) for _ in range(rng.randrange(1, 40))])
        for _ in range(rng.randrange(4)):
            index.extend(seq, [rng.randrange(12) for _ in range(rng.randrange(1, 9))])
            assert index.tokens <= 300 and index.nodes() <= 300 * 7
    _assert_exact(index)


def test_the_index_adds_no_objects_for_the_garbage_collector() -> None:
    """Its nodes are rows of arrays: indexing 20k tokens (~400k nodes) leaves the collector's
    object count nearly where it was (as objects, every full collection walked every node:
    ~100 ms, paid by whichever round it fell in)."""
    rng = random.Random(1)
    gc.collect()
    before = len(gc.get_objects())
    index = SuffixIndex()
    index.open([rng.randrange(2000) for _ in range(20000)])
    assert index.nodes() > 100_000
    assert len(gc.get_objects()) - before < 1000


def test_removed_nodes_are_reused() -> None:
    nodes = Nodes()
    a = nodes.child(ROOT, 5)
    b = nodes.child(a, 6)
    nodes.child(ROOT, 7)
    nodes.child(ROOT, 4)  # three children: held in a dict
    nodes.remove(ROOT, 5)  # a and its child b go
    assert nodes.get(ROOT, 5) == NONE and len(nodes) == 3
    assert {nodes.child(ROOT, 8), nodes.child(ROOT, 9)} == {a, b}
    assert sorted(token for token, _ in nodes.items(ROOT)) == [4, 7, 8, 9]
    assert not nodes.continued(a) and nodes.count[a] == 0


def test_the_oldest_sequence_is_trimmed_first_from_its_front() -> None:
    index = SuffixIndex(SuffixLimits(max_tokens=10, depth=4))
    first = index.open([1, 2, 3, 4])
    index.open([5, 6, 7, 8])
    index.open([9, 10, 11])  # 11 tokens: the oldest loses its first
    assert index.sequences() == [[2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]
    index.extend(first, [12, 13, 14, 15])  # still the oldest request: it loses its front
    assert index.sequences() == [[13, 14, 15], [5, 6, 7, 8], [9, 10, 11]]
    assert index.tokens == 10 and index.count([1]) == 0 and index.count([4, 12]) == 0
    _assert_exact(index)
    index.open(list(range(20, 40)))  # longer than the budget: only its last 10 tokens stay
    assert index.sequences() == [list(range(30, 40))]
    _assert_exact(index)


def test_many_threads_inserting_and_querying_keep_the_index_consistent() -> None:
    index = SuffixIndex(SuffixLimits(max_tokens=2000, depth=8))
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(30):
                seq = index.open([rng.randrange(16) for _ in range(rng.randrange(1, 30))])
                for _ in range(5):
                    index.extend(seq, [rng.randrange(16) for _ in range(rng.randrange(1, 6))])
                    context = [rng.randrange(16) for _ in range(6)]
                    tree = _propose(index, context, chain=False)
                    assert all(-1 <= p < i for i, p in enumerate(tree.parents))
                    assert all(0 < s <= 1 for s in tree.scores)
                    assert index.tokens <= 2000
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    _assert_exact(index)


def test_a_snapshot_restores_what_the_index_held() -> None:
    index = SuffixIndex(SuffixLimits(max_tokens=12, depth=4))
    seq = index.open([1, 2, 3, 4, 5])
    index.open([6, 7, 8])
    before = index.snapshot()
    index.extend(seq, [9, 9, 9, 9, 9])  # trims the oldest
    index.open([4, 4, 4])
    index.restore(before)
    assert index.sequences() == [[1, 2, 3, 4, 5], [6, 7, 8]]
    _assert_exact(index)
    assert index.open([1]) == 2  # ids go on from the snapshot's


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(max_tokens=1), "max_tokens must be an integer >= 2"),
        (dict(depth=1.5), "depth must be an integer >= 2"),
    ],
)
def test_bad_limits_are_clear_errors(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        SuffixLimits(**kwargs)


def test_bad_settings_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="max_match"):
        SuffixSettings(max_match=0)
    with pytest.raises(ConfigError, match="spec_factor"):
        SuffixSettings(spec_factor=0)
    with pytest.raises(ConfigError, match="min_prob"):
        SuffixSettings(min_prob=1.5)
    with pytest.raises(ConfigError, match="own"):
        SuffixSettings(own=1)


# ------------------------------------------------------------------------------ 2. the drafter


def test_a_request_indexes_its_prompt_and_what_the_target_commits() -> None:
    index = SuffixIndex()
    drafter = SuffixDrafter(index).begin([1, 2, 3, 1, 2])
    assert index.sequences() == [[1, 2, 3, 1, 2]]
    draft = drafter.propose([1, 2, 3, 1, 2], DraftShape(4), SamplingParams(), torch.Generator())
    # "1 2" occurred in the request's own text: what followed it there, as deep as the shape
    # (past the present the copy goes on from its own start: the text repeats every 3 tokens)
    assert draft.tokens.tolist() == [3, 1, 2, 3] and draft.q is None and draft.source == "suffix-2"
    # the target accepted "3" and emitted 7: the accepted token is indexed at once
    drafter.observe(Feedback(6, torch.tensor([2, 3, 1]), [0]))
    assert index.sequences() == [[1, 2, 3, 1, 2, 3]]
    history = [1, 2, 3, 1, 2, 3, 7]
    drafter.propose(history, DraftShape(4), SamplingParams(), torch.Generator())
    assert index.sequences() == [history]  # the rest of the history, when it drafts next
    other = SuffixDrafter(index).begin([9, 1, 2])  # a later request drafts from it
    got = other.propose([9, 1, 2], DraftShape(3), SamplingParams(), torch.Generator())
    assert got.tokens.tolist() == [3, 1]  # a match of 2 elsewhere drafts ⌈1 · 2⌉ tokens


def test_a_chain_copies_the_requests_own_latest_occurrence_unless_the_index_matches_longer():
    """SuffixDecoding's per-request tree: a match in the request's own text at least as long
    as the index's gives what followed its latest occurrence there (not the most frequent
    continuation over every request), as deep as the shape; a longer match elsewhere wins."""
    index = SuffixIndex()
    for _ in range(3):  # earlier requests: after "5 6" came 1 1 1, three times
        SuffixDrafter(index).begin([5, 6, 1, 1, 1, 0])
    greedy, rng = SamplingParams(), torch.Generator()
    own = SuffixDrafter(index).begin([5, 6, 2, 3, 4, 8, 5, 6])  # its own "5 6" went on 2 3 4
    assert own.propose([5, 6, 2, 3, 4, 8, 5, 6], DraftShape(4), greedy, rng).tokens.tolist() == [
        2,
        3,
        4,
        8,
    ]
    shared = SuffixDrafter(index, SuffixSettings(own=False)).begin([5, 6, 2, 3, 4, 8, 5, 6])
    assert shared.propose([5, 6, 2, 3, 4, 8, 5, 6], DraftShape(4), greedy, rng).tokens.tolist() == [
        1,
        1,
    ]  # own=False: the index alone, its most frequent continuation of "5 6"
    frequent = SuffixDrafter(index).begin([7, 5, 6])  # no own match: the index's frequent path
    assert frequent.propose([7, 5, 6], DraftShape(4), greedy, rng).tokens.tolist() == [1, 1]
    # its own "6" matches 1 token; the index matches "9 5 6" (3 tokens) from an earlier request
    SuffixDrafter(index).begin([9, 5, 6, 4, 4, 4])
    longer = SuffixDrafter(index).begin([6, 3, 9, 5, 6])
    assert longer.propose([6, 3, 9, 5, 6], DraftShape(4), greedy, rng).tokens.tolist() == [4, 4, 4]


class _CountingIndex(SuffixIndex):
    """A suffix index that counts the queries it answers."""

    def __init__(self, limits: SuffixLimits) -> None:
        super().__init__(limits)
        self.queries = 0

    def propose(self, context: list[int], **kwargs) -> Proposal:
        self.queries += 1
        return super().propose(context, **kwargs)


def test_an_own_match_as_long_as_the_index_can_match_skips_the_index_for_a_chain() -> None:
    """The index matches at most min(max_match, depth - 1) tokens: an own match that long
    wins whatever the index holds, so a chain is drafted without asking it (a tree still
    asks it for the nodes around the own chain); shorter own matches ask it."""
    index = _CountingIndex(SuffixLimits(depth=5))  # matches of at most 4 tokens
    index.open([1, 2, 3, 4, 9, 9])  # an earlier request: after 1 2 3 4 came 9 9
    history = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]  # its own 1 2 3 4 went on 5 6
    drafter = SuffixDrafter(index).begin(history)
    greedy, rng = SamplingParams(), torch.Generator()
    chain = drafter.propose(history, DraftShape(2), greedy, rng)
    assert chain.tokens.tolist() == [5, 6] and index.queries == 0
    tree = drafter.propose(history, DraftShape(2, "forks", forks=2), greedy, rng)
    assert tree.tokens.tolist()[:2] == [5, 6] and 9 in tree.tokens.tolist()
    assert index.queries == 1
    short = SuffixDrafter(index).begin([7, 3, 4, 8, 3, 4])  # own match "3 4": 2 tokens
    assert short.propose([7, 3, 4, 8, 3, 4], DraftShape(2), greedy, rng).tokens.tolist()
    assert index.queries == 2


def test_a_tree_has_the_own_chain_first_and_the_indexs_nodes_around_it() -> None:
    """A tree shape (a SPORK source): the own chain is the first path (scores 1), the index's
    nodes not already on it follow by their scores, within the node budget."""
    index = SuffixIndex()
    for _ in range(3):
        SuffixDrafter(index).begin([5, 6, 1, 1, 1, 0])
    history = [5, 6, 2, 3, 4, 8, 5, 6]
    own = SuffixDrafter(index).begin(history)
    greedy, rng = SamplingParams(), torch.Generator()
    tree = own.propose(history, DraftShape(2, "forks", forks=2), greedy, rng)
    assert tree.tokens.tolist() == [2, 3, 1, 1] and tree.tree.parents.tolist() == [-1, 0, -1, 2]
    assert tree.scores.tolist() == pytest.approx([1, 1, 3 / 4, 3 / 4])
    small = own.propose(history, DraftShape(2, "dynamic", forks=2, budget=3), greedy, rng)
    assert small.tokens.tolist() == [2, 3, 1] and small.tree.parents.tolist() == [-1, 0, -1]


def test_the_own_history_finds_the_latest_longest_match() -> None:
    """`LocalMatches`: the longest suffix up to the bound, its latest occurrence on ties, and
    only occurrences followed by something (the history's own end is not one)."""
    local = LocalMatches()
    local.extend([1, 2, 3, 9, 2, 3, 7, 1, 2, 3])
    assert local.longest(8) == LocalMatch(3, 2)  # "1 2 3" at 0..2 beats the later "2 3"
    assert local.longest() == LocalMatch(3, 2)  # up to LONGEST by default
    assert local.longest(2) == LocalMatch(2, 5)  # bounded to 2: the latest "2 3"
    assert local.following(LocalMatch(3, 2), 4) == [9, 2, 3, 7]  # what followed "1 2 3"
    # the latest "2 3" ends 4 tokens back: "7 1 2 3" followed it, and repeats past the present
    assert local.following(LocalMatch(2, 5), 6) == [7, 1, 2, 3, 7, 1]
    local.extend([5])
    assert local.longest(8) is None  # 5 occurred nowhere before
    assert LocalMatches().longest(4) is None


def test_a_tree_shape_gets_a_tree_and_a_chain_shape_the_best_path() -> None:
    index = SuffixIndex()
    SuffixDrafter(index).begin([5, 6, 1, 5, 6, 1, 5, 6, 2, 0])
    drafter = SuffixDrafter(index, SuffixSettings(spec_factor=2.0)).begin([4])
    rng = torch.Generator()
    chain = drafter.propose([4, 5, 6], DraftShape(3), SamplingParams(), rng)
    assert chain.is_chain and chain.tokens.tolist() == [1, 5, 6]
    tree = drafter.propose([4, 5, 6], DraftShape(2, "forks", forks=2), SamplingParams(), rng)
    assert tree.tokens.tolist() == [1, 5, 2, 0] and tree.tree.parents.tolist() == [-1, 0, -1, 2]
    assert tree.scores.tolist() == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])


# ------------------------------------------------------------------------------ 3. decoding

CURVE = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.25, 1.5, 2.3, 3.9, 6.8))
PROMPT = "abc abc abc abc, one two three one two three"
N = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, one_thread) -> LoadedModel:
    folder = tiny_chat_llama(tmp_path_factory.mktemp("suffix") / "target", chat=False, seed=11)
    return load_model(str(folder), dtype="float32", device="cpu", progress=False)


SPECS = {
    "speculative": SpecConfig("speculative", "suffix", k=4, goodput=False),
    "speculative-gated": SpecConfig("speculative", "suffix", k=4),
    "dspark": SpecConfig("dspark", "suffix", low=0.0, goodput=False),
    "ngram+suffix": SpecConfig("speculative", "ngram+suffix", k=4, goodput=False),
    "spork": SpecConfig("spork", "recycle+suffix", goodput=False),
    "spork-dynamic": SpecConfig("spork", "suffix", tree="dynamic", budget=12),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_output_is_plain_decodings_token_for_token(tiny: LoadedModel, name: str) -> None:
    config = GenerationConfig(max_new_tokens=N, ignore_eos=True)
    plain = Generator(tiny, cost_curve=CURVE)
    gen = Generator(tiny, spec=SPECS[name], cost_curve=CURVE)
    drafted = 0
    for prompt in (PROMPT, "one two three", PROMPT):  # the third drafts from the first two
        want = plain.generate(prompt, config=config)
        got = gen.generate(prompt, config=config)
        assert got.token_ids == want.token_ids, (name, prompt)
        drafted += got.stats.drafted
    assert drafted > 0


def test_a_second_request_drafts_from_the_first(tiny: LoadedModel) -> None:
    """On a repeated prompt the shared index knows the first answer: the second request
    accepts more than the same request on a fresh index (one Generator's index is its own)."""
    spec = SPECS["speculative"]
    config = GenerationConfig(max_new_tokens=N, ignore_eos=True)
    prompt = "seven eight nine ten"
    shared = Generator(tiny, spec=spec, cost_curve=CURVE)
    first = shared.generate(prompt, config=config)
    second = shared.generate(prompt, config=config)
    fresh = Generator(tiny, spec=spec, cost_curve=CURVE).generate(prompt, config=config)
    assert second.token_ids == first.token_ids == fresh.token_ids
    assert fresh.stats.accepted == first.stats.accepted  # a fresh index: the same drafts
    assert second.stats.accepted > fresh.stats.accepted
    assert second.stats.target_forwards < fresh.stats.target_forwards


def test_batched_requests_share_the_index_and_decode_as_plain(tiny: LoadedModel) -> None:
    """Requests running together (the scheduler interleaves their rounds) each append to
    their own sequence of the one index, and emit plain decoding's tokens."""
    config = GenerationConfig(max_new_tokens=N, ignore_eos=True)
    prompts = [PROMPT, "one two three", PROMPT, "seven eight nine ten"]
    plain = [Generator(tiny, cost_curve=CURVE).generate(p, config=config) for p in prompts]
    gen = Generator(tiny, spec=SPECS["speculative"], cost_curve=CURVE)
    got = generate_batch(gen, prompts, config=config)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert sum(r.stats.accepted for r in got) > 0
    held = gen.stores.suffix.sequences()
    assert len(held) == len(prompts)
    for seq, result in zip(held, got, strict=True):  # prompt + output, all but the last token
        assert seq[-(N - 1) :] == result.token_ids[: N - 1]


def test_strategies_of_one_generator_share_its_index(tiny: LoadedModel) -> None:
    stores = DraftStores(SuffixIndex(SuffixLimits(max_tokens=4096)))
    gen = Generator(tiny, spec=SPECS["speculative"], cost_curve=CURVE, stores=stores)
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    gen.generate("one two", config=config)
    gen.generate("one two", config=config, spec=SPECS["spork"])
    assert len(stores.suffix.sequences()) == 2  # both requests, both strategies, one index
    assert stores.suffix.tokens <= 4096
    with pytest.raises(ConfigError, match="stores must be a DraftStores"):
        Generator(tiny, stores=object())  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ 4. sampling

VOCAB = 6
SAMPLES = 12_000
PREFIX = [0, 1, 2, 0, 1]


def _joint_counts(params: SamplingParams, broken: bool, seed: int = 0) -> tuple:
    """Joint counts of the first three tokens of speculative sampling with suffix drafts (up
    to the second token) from an index that learns every sample's output, and the exact joint
    of the target (a random distribution after every prefix). `broken`: always accept (a
    negative control)."""
    gen = torch.Generator().manual_seed(seed)
    logits = [
        2 * torch.randn(VOCAB, generator=gen),
        2 * torch.randn(VOCAB, VOCAB, generator=gen),
        2 * torch.randn(VOCAB, VOCAB, VOCAB, generator=gen),
    ]

    def target(emitted: list[int]) -> torch.Tensor:  # [V] the target's logits after `emitted`
        return logits[len(emitted)][tuple(emitted)]

    root = SuffixDrafter(SuffixIndex(SuffixLimits(max_tokens=3000, depth=8)))
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    tally = Counter()  # drafted and accepted tokens
    for _ in range(SAMPLES):
        drafter, emitted = root.begin(PREFIX), []
        while len(emitted) < 3:
            history = PREFIX + emitted
            draft = drafter.propose(history, DraftShape(max(0, 2 - len(emitted))), params, gen)
            path = emitted + draft.tokens.tolist()
            rows = [target(path[:i]) for i in range(len(emitted), len(path) + 1)]
            p = probabilities(torch.stack(rows), params)  # [K + 1, V]
            if broken:
                out = [*draft.tokens.tolist(), int(sample(p[len(draft)], gen))]
            else:
                out = verify_sampling(draft.tokens, p, None, gen).tokens
            verified = torch.tensor([history[-1], *draft.tokens.tolist()])
            accepted = len(out) - 1
            tally.update(drafted=len(draft), accepted=accepted)
            drafter.observe(Feedback(len(history) + accepted, verified, list(range(accepted))))
            emitted += out
        counts[tuple(emitted[:3])] += 1
    exact = probabilities(logits[0], params).double()[:, None, None]
    exact = exact * probabilities(logits[1], params).double()[:, :, None]
    return counts, exact * probabilities(logits[2], params).double(), tally


SAMPLING = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)]


@pytest.mark.parametrize("params", SAMPLING, ids=["t1", "t0.7-top_p0.9"])
def test_sampling_with_suffix_drafts_keeps_the_target_distribution(params) -> None:
    counts, exact, tally = _joint_counts(params, broken=False)
    assert tally["drafted"] > SAMPLES and 0 < tally["accepted"] < tally["drafted"]  # it drafts
    assert goodness_of_fit(counts.flatten(), exact.flatten()) > 1e-3
    tv = 0.5 * float((counts / counts.sum() - exact).abs().sum())
    assert tv < 0.05, tv


def test_always_accepting_suffix_drafts_fails_the_same_test() -> None:
    counts, exact, _ = _joint_counts(SAMPLING[0], broken=True)
    assert goodness_of_fit(counts.flatten(), exact.flatten()) < 1e-3


# ------------------------------------------------------------------------------ 5. kept on disk


def test_a_saved_index_loads_back_within_the_budget(tmp_path: Path) -> None:
    index = SuffixIndex()
    index.open([1, 2, 3])
    index.open([4, 5, 6, 7])
    path = tmp_path / "suffix" / "m-suffix.safetensors"
    assert save_index(index, path)
    again = SuffixIndex()
    assert load_index(again, path) and again.sequences() == [[1, 2, 3], [4, 5, 6, 7]]
    _assert_exact(again)
    small = SuffixIndex(SuffixLimits(max_tokens=5))
    assert load_index(small, path) and small.sequences() == [[3], [4, 5, 6, 7]]  # the newest
    assert save_index(SuffixIndex(), path) and load_index(again, path)
    assert again.sequences() == []


def test_a_missing_or_broken_file_leaves_the_index_as_it_was(tmp_path: Path) -> None:
    index = SuffixIndex()
    index.open([1, 2])
    assert not load_index(index, tmp_path / "none.safetensors")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    assert not load_index(index, broken)
    other = tmp_path / "other.safetensors"
    save_file({"tokens": torch.zeros(1), "lengths": torch.ones(1)}, other, {"format": "0"})
    assert not load_index(index, other)
    assert index.sequences() == [[1, 2]]


def test_generate_keeps_the_index_between_runs(
    tiny: LoadedModel, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--suffix-persist`: the second run starts from the first one's index (its file in the
    cache folder holds both requests) and drafts the answer it wrote."""
    monkeypatch.setenv("SPECFORK_CACHE_DIR", str(tmp_path))
    argv = ["generate", "-m", str(tiny.path), "--strategy", "speculative", "--drafter"]
    argv += ["suffix", "--no-goodput", "--suffix-persist", "-n", "24", "--ignore-eos", "--stats"]
    argv += ["--kernels", "off", "--dtype", "float32"]  # nothing to build in the new cache folder
    accepted = []
    for _ in range(2):
        code, _, err = run_cli(capsys, [*argv, "seven eight nine ten"])
        assert code == 0, err
        accepted.append(int(re.search(r"accepted: (\d+)", err).group(1)))
    kept = load_index(held := SuffixIndex(), index_file(tmp_path / "suffix", tiny.path))
    assert kept and len(held.sequences()) == 2
    assert accepted[1] > accepted[0]


# ------------------------------------------------------------------------------ 6. front ends


def test_the_bench_resets_the_index_before_every_repeat_of_a_turn() -> None:
    index = SuffixIndex()
    reset = TurnReset(index)
    one = PreparedPrompt(0, BenchPrompt("q0", "writing", "x"), [1, 2])
    two = PreparedPrompt(1, BenchPrompt("q1", "writing", "x"), [1, 2])  # the same text
    reset.before_run(one)
    index.open([1, 2, 3])  # what the first repeat learned
    reset.before_run(one)  # the second repeat: as before the first
    assert index.sequences() == []
    index.open([1, 2, 4])
    reset.before_run(two)  # the next prompt learns from its predecessor's last repeat
    assert index.sequences() == [[1, 2, 4]]
    index.open([1, 2, 5])
    reset.before_run(two)
    assert index.sequences() == [[1, 2, 4]]


def test_a_bench_run_learns_across_prompts_but_not_across_repeats(tiny: LoadedModel) -> None:
    """Prompt 2 repeats prompt 1's text: the suffix strategy drafts it from prompt 1's answer,
    while each repeat of a prompt drafts as its first did (its index reset in between)."""
    text = "seven eight nine ten"
    prompts = [BenchPrompt(1, "qa", text), BenchPrompt(2, "qa", text)]
    strategies = parse_strategies("ar,speculative:suffix?k=4&goodput=false")
    settings = BenchSettings(strategies, prompts, max_new_tokens=N, repeats=2, warmup=1)
    results = run_benchmark(settings, loaded=tiny, show_progress=False)
    accepted = {
        (m.prompt_index, m.repeat): m.output.accepted
        for m in results.measurements
        if m.strategy == "speculative:suffix?k=4&goodput=false" and m.output is not None
    }
    assert accepted[0, 0] == accepted[0, 1] and accepted[1, 0] == accepted[1, 1]
    assert accepted[1, 0] > accepted[0, 0]
    assert isolation.SUFFIX_NOTE in results.notes


def test_the_cli_and_the_server_objects_name_the_same_suffix_drafter() -> None:
    args = build_parser().parse_args(
        ["generate", "--strategy", "speculative", "--drafter", "suffix"]
    )
    resolve_strategy(args)
    from_cli = spec_from_args(args, expected_length=SpecConfig().expected_length)
    assert from_cli == spec_with(SpecConfig(), {"strategy": "speculative", "drafter": "suffix"})
    assert spec_with(SpecConfig(), {"strategy": "spork", "drafter": "recycle+suffix"}).drafts_with(
        "suffix"
    )


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--drafter", "suffix:/x"],
            "drafter 'suffix:/x': suffix is written suffix (takes no PATH)",
        ),
        (["--strategy", "spork", "--drafter", "recycle+suffix:a"], "suffix is written suffix"),
    ],
)
def test_a_suffix_with_a_path_is_a_clear_cli_error(capsys, flags: list[str], words: str) -> None:
    strategy = [] if "--strategy" in flags else ["--strategy", "speculative"]
    code, out, err = run_cli(capsys, ["generate", "-m", "no-such-model", *strategy, *flags, "hi"])
    assert code == 2 and out == "" and "Traceback" not in err  # before any model loads
    assert words in err
