"""SPORK: tree shapes, the fork drafter, adaptation, bad input (no model needed)."""

import pytest
import torch

from specfork.config import SamplingParams, SpecConfig
from specfork.drafters.base import Draft, DraftShape, Feedback, chain_draft
from specfork.drafters.forks import ForkDrafter, _cap
from specfork.errors import ConfigError
from specfork.strategies.policies import RoundInfo
from specfork.strategies.spork import SporkPolicy
from specfork.tree import Tree, children, depths, node_scores

pytestmark = pytest.mark.usefixtures("one_thread")

V = 32


# ----------------------------------------------------------------------------- scores, caps


def _capped(tree: Tree, scores: torch.Tensor, tau: float, max_nodes: int) -> tuple[Tree, list]:
    """`_cap` of a Tree and its scores tensor."""
    return _cap(tree.tokens.tolist(), tree.parents.tolist(), scores.tolist(), tau, max_nodes)


def test_node_scores_multiply_inverse_sibling_ranks() -> None:
    # root children: 0 (rank 0), 1 (rank 1), 4 (rank 2); node 0's children: 2, 3; node 2: 5
    tree = Tree([5, 6, 7, 8, 9, 10], [-1, -1, 0, 0, -1, 2])
    want = [1.0, 1 / 2, 1.0, 1 / 2, 1 / 3, 1.0]
    assert node_scores(tree).tolist() == pytest.approx(want)


def test_cap_drops_nodes_below_tau_and_their_subtrees() -> None:
    tree = Tree([5, 6, 7, 8, 9, 10], [-1, -1, 0, 0, -1, 1])
    capped, kept = _capped(tree, node_scores(tree), tau=0.5, max_nodes=100)  # 4 (1/3) goes
    assert capped.tokens.tolist() == [5, 6, 7, 8, 10]
    assert capped.parents.tolist() == [-1, -1, 0, 0, 1]
    assert kept == [0, 1, 2, 3, 5]


def test_cap_keeps_the_best_nodes_and_their_ancestors() -> None:
    tree = Tree([5, 6, 7, 8, 9], [-1, 0, 1, -1, 3])  # chain 5-6-7 (score 1), fork 8-9 (1/2)
    capped, _ = _capped(tree, node_scores(tree), tau=0.0, max_nodes=4)
    assert capped.tokens.tolist() == [5, 6, 7, 8]
    assert set(capped.parents.tolist()) <= {-1, 0, 1}


def test_tau_never_drops_the_best_first_guess() -> None:
    """Cumulative draft probabilities all below τ: the best first-level node is still sent
    (its own subtree below τ goes), so a round that paid for drafting verifies something."""
    tree = Tree([5, 6, 7, 8], [-1, -1, 1, 2])
    scores = torch.tensor([0.2, 0.3, 0.25, 0.1], dtype=torch.float64)  # [N]
    capped, _ = _capped(tree, scores, tau=0.5, max_nodes=24)
    assert capped.tokens.tolist() == [6] and capped.parents.tolist() == [-1]
    assert len(_capped(tree, scores, tau=0.0, max_nodes=0)[0]) == 0  # no room: nothing


# ----------------------------------------------------------------------------- fork drafter


class FixedChain:
    """A chain drafter that always proposes the same tokens (cut to the depth)."""

    name = "fixed"
    cost = 0.0
    wants_logits = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.committed: list[int] = []

    def begin(self, prompt_ids: list[int]) -> None:
        return None

    def propose(self, history, shape, sampling, rng) -> Draft:
        tokens = torch.tensor(self.tokens[: shape.depth], dtype=torch.long)
        return chain_draft(tokens, forwards=1, source=self.name)

    def observe(self, feedback: Feedback) -> None:
        self.committed.append(feedback.committed)


def _propose(drafter: ForkDrafter, history: list[int], **shape) -> tuple[Draft, Tree]:
    draft = drafter.propose(history, DraftShape(**shape), SamplingParams(), torch.Generator())
    return draft, draft.tree


def _table_drafter(chain: list[int] | None = None) -> ForkDrafter:
    chains = {"fixed": FixedChain(chain)} if chain is not None else {}
    drafter = ForkDrafter(V, recycle=True, chains=chains).begin([1, 2, 3])
    # successors: 1 -> [2, 3, 4], 2 -> [5, ...], 3 -> [6, ...], 4 -> [7, ...], 5 -> [8, ...]
    logits = torch.full((5, V), -10.0)
    for row, succ in enumerate([[2, 3, 4], [5], [6], [7], [8]]):
        for rank, s in enumerate(succ):
            logits[row, s] = 10.0 - rank
    drafter.observe(Feedback(5, torch.tensor([1, 2, 3, 4, 5]), [], logits))
    return drafter


def test_recycled_forks_walk_the_table() -> None:
    drafter = _table_drafter()
    draft, tree = _propose(drafter, [9, 1], kind="forks", forks=3, depth=3, budget=24)
    paths = {tuple(tree.tokens[i].item() for i in _path(tree, leaf)) for leaf in _leaves(tree)}
    assert paths == {(2, 5, 8), (3, 6), (4, 7)}  # 6 and 7 have no known successor: forks stop
    assert [tree.tokens[c].item() for c in children(tree)[0]] == [2, 3, 4]
    assert draft.scores is not None and len(draft.scores) == len(tree)
    assert int(depths(tree).max()) <= 3


def test_chain_branches_come_first_and_share_nodes_with_forks() -> None:
    drafter = _table_drafter(chain=[3, 6, 11])
    draft, tree = _propose(drafter, [9, 1], kind="forks", forks=3, depth=3, budget=24)
    first = [tree.tokens[c].item() for c in children(tree)[0]]
    assert first == [3, 2, 4]  # the chain's 3 first, the recycled 3 merged into it
    assert tree.tokens.tolist().count(6) == 1  # 3 -> 6 shared by the chain and the fork
    assert draft.forwards == 1


def test_merged_nodes_name_the_source_that_proposed_them() -> None:
    drafter = _table_drafter(chain=[3, 6, 11])
    draft, tree = _propose(drafter, [9, 1], kind="forks", forks=3, depth=3, budget=24)
    origin = {tok: draft.origin(i) for i, tok in enumerate(tree.tokens.tolist())}
    assert origin == {
        3: "fixed",
        6: "fixed",
        11: "fixed",
        2: "recycle",
        5: "recycle",
        8: "recycle",
        4: "recycle",
        7: "recycle",
    }
    keep = tree.tokens != 11  # [N]: a subset keeps its nodes' origins
    kept = draft.subset(keep)
    assert [kept.origin(i) for i in range(len(kept))] == [
        o for o, k in zip(draft.origins, keep.tolist(), strict=True) if k
    ]


def test_tree_respects_depth_and_node_limits() -> None:
    drafter = _table_drafter(chain=[3, 6, 11, 12, 13])
    _, tree = _propose(drafter, [9, 1], kind="dynamic", forks=3, depth=2, budget=4)
    assert len(tree) <= 4 and int(depths(tree).max()) <= 2
    _, empty = _propose(drafter, [9, 1], kind="dynamic", forks=3, depth=0, budget=4)
    assert len(empty) == 0


def test_unknown_root_gives_an_empty_tree() -> None:
    drafter = _table_drafter()
    _, tree = _propose(drafter, [9, 30], kind="forks", forks=3, depth=3, budget=24)
    assert len(tree) == 0


def test_feedback_reaches_the_chain_drafters() -> None:
    chain = FixedChain([1])
    drafter = ForkDrafter(V, recycle=False, chains={"fixed": chain})
    drafter.observe(Feedback(17, torch.tensor([1])))
    assert chain.committed == [17] and drafter.name == "fixed"
    assert not drafter.wants_logits and drafter.cost == 0


# ----------------------------------------------------------------------------- adaptation


def _path(tree: Tree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = int(tree.parents[node])
    return out[::-1]


def _leaves(tree: Tree) -> list[int]:
    kids = children(tree)
    return [i for i in range(len(tree)) if not kids[i + 1]]


def _round(nodes: int, accepted: int, fork: int | None, depth: int = 4) -> RoundInfo:
    return RoundInfo(nodes, accepted, 10, None, fork=fork, tree_depth=depth)


def test_two_fallbacks_in_a_row_narrow_and_shorten_the_tree() -> None:
    pol = SporkPolicy(SpecConfig("spork", forks=4, depth=4))
    pol.update(_round(16, 0, None))
    assert (pol.forks, pol.depth) == (4, 4)  # one fallback is not a trend
    pol.update(_round(16, 0, None))
    assert (pol.forks, pol.depth) == (3, 3)


def test_a_win_resets_the_fallback_streak() -> None:
    pol = SporkPolicy(SpecConfig("spork", forks=4, depth=4))
    pol.update(_round(16, 0, None))
    pol.update(_round(16, 1, 0))
    pol.update(_round(16, 0, None))
    assert (pol.forks, pol.depth) == (4, 4)


def test_the_widest_fork_winning_adds_a_fork_up_to_twice_the_start() -> None:
    pol = SporkPolicy(SpecConfig("spork", forks=2, depth=4))
    for _ in range(5):
        pol.update(_round(8, 1, pol.forks - 1))
    assert pol.forks == 4


def test_whole_forks_accepted_deepen_the_tree_within_bounds() -> None:
    pol = SporkPolicy(SpecConfig("spork", forks=2, depth=3))
    for _ in range(10):
        pol.update(_round(8, pol.depth, 0, depth=pol.depth))
    assert pol.depth == 6


def test_tau_moves_toward_the_target_acceptance() -> None:
    pol = SporkPolicy(SpecConfig("spork", tau=0.2, tau_max=0.5, target_acceptance=0.7))
    pol.update(_round(16, 0, None, depth=4))  # acceptance 0 < 0.7: prune harder
    assert pol.tau == pytest.approx(0.2 + 0.05 * 0.7)
    pol.update(_round(16, 4, 0, depth=4))  # acceptance 1 > 0.7: send more
    assert pol.tau == pytest.approx(0.2 + 0.05 * 0.7 - 0.05 * 0.3)
    for _ in range(100):
        pol.update(_round(16, 0, None))
    assert pol.tau == 0.5  # bounded by tau_max


def test_tau_stays_between_zero_and_its_bound() -> None:
    """The default bound 0 keeps tau at 0 (nothing pruned); a start above tau_max is the
    bound instead, so --tau alone works."""
    pol = SporkPolicy(SpecConfig("spork"))
    for _ in range(20):
        pol.update(_round(16, 0, None))
    assert pol.tau == 0.0
    pol = SporkPolicy(SpecConfig("spork", tau=0.3))
    for _ in range(20):
        pol.update(_round(16, 0, None))
    assert pol.tau == 0.3
    for _ in range(20):
        pol.update(_round(16, 4, 0, depth=4))
    assert pol.tau == 0.0


def test_no_adapt_keeps_the_shape() -> None:
    pol = SporkPolicy(SpecConfig("spork", forks=3, depth=5, tau=0.1, adapt=False))
    for _ in range(4):
        pol.update(_round(16, 0, None))
    assert pol.next_shape(0) == DraftShape(5, "forks", 3, 24, 0.1)


def test_empty_trees_do_not_adapt_and_reset_restores() -> None:
    pol = SporkPolicy(SpecConfig("spork"))
    for _ in range(3):
        pol.update(_round(0, 0, None, depth=0))
    assert (pol.forks, pol.depth, pol.tau) == (4, 4, 0.0)
    pol.update(_round(16, 0, None))
    pol.update(_round(16, 0, None))
    fresh = pol.begin()
    assert (fresh.forks, fresh.depth, fresh.tau, fresh.trace()) == (4, 4, 0.0, {})
    assert (pol.forks, pol.depth) == (3, 3)  # the narrowed request keeps its own shape


def test_trace_fields() -> None:
    pol = SporkPolicy(SpecConfig("spork"))
    pol.update(_round(12, 2, 1))
    t = pol.trace()
    assert t["fork"] == 1 and t["nodes"] == 12 and t["forks"] == 4 and t["next_forks"] == 4
    assert {"depth", "tau", "tree_depth", "next_depth", "next_tau"} <= set(t)


def test_free_sources_have_no_model_depth() -> None:
    pol = SporkPolicy(SpecConfig("spork"))
    assert pol.next_shape(0).model_depth is None
    pol.update(_round(12, 2, 1))
    assert "model_depth" not in pol.trace()


def test_model_levels_that_do_not_pay_for_their_forward_are_dropped() -> None:
    """c = 0.7: rounds accepting one token reach level 1 only, so deeper self-drafted levels
    return less than they cost, down to one level (never zero: the tree needs its forks)."""
    pol = SporkPolicy(SpecConfig("spork", forks=4, depth=4), draft_cost=0.7)
    assert pol.next_shape(0).model_depth == 4
    seen = []
    for _ in range(60):
        m = pol.next_shape(0).model_depth
        pol.update(_round(16, 1, 0, depth=m))
        seen.append(m)
    assert seen[:4] == [4, 3, 2, 1]  # one level dropped per round
    assert seen[4:].count(1) >= 0.85 * len(seen[4:])  # level 2 only retried now and then
    assert max(seen[4:]) == 2 and pol.depth == 4  # the free sources' depth is untouched


def test_model_levels_that_pay_grow_after_whole_accepts() -> None:
    pol = SporkPolicy(SpecConfig("spork", forks=2, depth=2), draft_cost=0.1)
    for _ in range(10):
        m = pol.next_shape(0).model_depth
        pol.update(_round(8, m, 0, depth=m))
    assert pol.next_shape(0).model_depth == pol.depth == 4  # bounded by twice the start


def test_a_cheap_drafter_keeps_its_depth_where_a_costly_one_sheds_it() -> None:
    """The same acceptance pattern (half the rounds reach level 2, none level 3), two costs."""
    depths = {}
    for cost in (0.05, 0.9):
        pol = SporkPolicy(SpecConfig("spork", forks=3, depth=3, adapt=True), draft_cost=cost)
        for i in range(40):
            m = pol.next_shape(0).model_depth
            pol.update(_round(9, min(m, 1 + i % 2), 0, depth=m))
        depths[cost] = pol.next_shape(0).model_depth
    assert depths[0.05] >= 2 and depths[0.9] == 1


def test_no_adapt_keeps_the_model_depth() -> None:
    pol = SporkPolicy(SpecConfig("spork", depth=3, adapt=False), draft_cost=0.7)
    for _ in range(5):
        pol.update(_round(9, 0, None, depth=3))
    assert pol.next_shape(0).model_depth == 3


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"forks": 0}, "forks must be an integer >= 1"),
        ({"depth": 0}, "depth must be an integer >= 1"),
        ({"depth": 8, "budget": 4}, "smaller than the depth"),
        ({"tau": 1.0}, r"tau must be in \[0, 1\)"),
        ({"tau": -0.1}, r"tau must be in \[0, 1\)"),
        ({"tau_max": 1.0}, r"tau_max must be in \[0, 1\)"),
        ({"tau_max": -0.1}, r"tau_max must be in \[0, 1\)"),
        ({"tree": "bushy"}, "unknown tree shape"),
        ({"drafter": "recycle+bogus"}, "unknown spork drafter 'bogus'"),
        ({"target_acceptance": 0.0}, "target_acceptance"),
        ({"typical_epsilon": 0.0}, "typical_epsilon"),
    ],
)
def test_bad_spork_settings(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        SpecConfig("spork", **kwargs)


def test_recycle_needs_spork_and_lossy_needs_spork() -> None:
    with pytest.raises(ConfigError, match="strategy spork"):
        SpecConfig("speculative", drafter="recycle")
    with pytest.raises(ConfigError, match="SPORK option"):
        SpecConfig("speculative", lossy_typical=True)


def test_default_drafter_depends_on_the_strategy() -> None:
    assert SpecConfig("spork").drafter == "recycle"
    assert SpecConfig("speculative").drafter == "ngram"


def test_sampling_params_unused_by_chains_are_greedy() -> None:
    """Tree branches are deterministic (verified as one-hot q), whatever the request samples."""
    from specfork.drafters.forks import GREEDY

    assert SamplingParams() == GREEDY and GREEDY.greedy


@pytest.mark.parametrize("persist", [False, True])
def test_recycle_table_persists_across_requests_only_when_asked(persist: bool) -> None:
    shared = ForkDrafter(V, recycle=True, chains={}, persist=persist)
    first = shared.begin([1])
    first.observe(Feedback(1, torch.tensor([1]), [], torch.arange(V, dtype=torch.float32)[None]))
    assert first.table is not None and first.table.candidates(1, 1) == [V - 1]
    second = shared.begin([2])  # the next request
    assert second.table is not None
    assert second.table.candidates(1, 1) == ([V - 1] if persist else [])
    assert first.table.candidates(1, 1) == [V - 1]  # the first request keeps what it learnt


@pytest.mark.slow
def test_model_forks_are_batched_greedy_continuations(smollm_f32) -> None:
    """Each fork equals a greedy continuation computed on its own, one fresh forward per step:
    the batched step with the fork mask over the shared prefix cache is exact."""
    from specfork.drafters.model import ModelDrafter

    model = smollm_f32.model
    layers = list(range(0, 20))
    history = smollm_f32.tokenizer.encode("The three primary colours are red, blue and")
    drafter = ModelDrafter(model, layers=layers, name="self").begin(history)
    paths, probs, forwards = drafter.propose_forks(history, forks=3, depth=4)
    assert forwards == 4 and len(paths) == 3 and all(len(p) == 4 for p in paths)
    assert len({p[0] for p in paths}) == 3  # distinct first tokens, best first
    with torch.inference_mode():
        for path, prob in zip(paths, probs, strict=True):
            assert prob == sorted(prob, reverse=True)  # cumulative probabilities shrink
            for i in range(1, len(path)):
                cache = model.new_cache(len(history) + 8)
                logits = model.extend([*history, *path[:i]], cache, layers=layers)
                assert int(logits.argmax()) == path[i]
                step = float(logits.softmax(-1).max())
                assert prob[i] == pytest.approx(prob[i - 1] * step, rel=1e-4)
    assert drafter.cache.length == len(history)  # the fork tokens left the cache again


@pytest.mark.slow
def test_model_dynamic_tree_expands_the_most_probable_frontier(smollm_f32) -> None:
    """EAGLE-2: every level's children are the top-`branch` next tokens of the `branch` most
    probable nodes of the level above, each scored by its cumulative draft probability."""
    from specfork.drafters.model import ModelDrafter
    from specfork.tree import path_to

    model = smollm_f32.model
    layers = list(range(0, 20))
    history = smollm_f32.tokenizer.encode("Once upon a time, in a small village,")
    drafter = ModelDrafter(model, layers=layers, name="self").begin(history)
    branch, depth = 3, 3
    tree, scores, forwards = drafter.propose_dynamic(history, branch, depth)
    assert forwards == depth and len(tree) == branch + (depth - 1) * branch * branch
    level_of = depths(tree).tolist()
    kids = children(tree)
    with torch.inference_mode():
        for level in range(1, depth + 1):
            nodes = [i for i, d in enumerate(level_of) if d == level]
            expanded = [n for n in nodes if kids[n + 1]]
            if level < depth:  # the frontier: the `branch` best of the level
                best = sorted(nodes, key=lambda n: -scores[n])[:branch]
                assert sorted(expanded) == sorted(best)
            for node in [-1, *expanded] if level == 1 else expanded:
                path = [int(tree.tokens[i]) for i in path_to(tree, node)]
                cache = model.new_cache(len(history) + 8)
                q = model.extend([*history, *path], cache, layers=layers).softmax(-1)
                top = q.topk(branch)
                below = kids[node + 1]
                assert [int(tree.tokens[c]) for c in below] == top.indices.tolist()
                base = 1.0 if node < 0 else scores[node]
                for c, qc in zip(below, top.values.tolist(), strict=True):
                    assert scores[c] == pytest.approx(base * qc, rel=1e-4)
    assert drafter.cache.length == len(history)  # the drafted nodes left the cache again
