"""Tree verification: greedy and typical unit tests; statistical tests that sampling is lossless.

Distribution tests (ARCHITECTURE.md, "Testing"), for trees. The target and the drafter are
bigram models over a small vocabulary: at the root the target's distribution is p0 and the
drafter's q0; after a token y they are P[y] and Q[y] (all through `sampling.probabilities` with
the same parameters). A Markov target is a valid language model, so a lossless verifier's
emitted tokens must satisfy: token 0 ~ p0, and token j given token j - 1 = y ~ P[y]. Every
round drafts a tree of a fixed shape whose nodes are either drawn from the drafter at their
parent (i.i.d. siblings, verified with q) or deterministic (the drafter's j-th most likely
token at the parent, verified with one-hot q), runs `verify_tree_sampling` with a seeded
generator and records the emitted tokens. Per configuration the test requires:

- position 0: chi-square goodness of fit against p0 (bins with expected count < 5 merged),
  p-value >= 1e-3, and total variation <= 0.01 from p0;
- position j >= 1 (where a round reached it): the chi-square statistics of token j against
  P[y] in every group of rounds whose token j - 1 is y, summed (with their degrees of
  freedom) into one test, p-value >= 1e-3;
- no token with target probability 0 is ever emitted;
- the rate at which the root's children accept one of them equals the exact value
  1 - prod_k (1 - beta_k), beta_k = sum min(r_k, q_k), r_{k+1} = normalise(max(0, r_k - q_k)),
  within 5 binomial sigma.

Rounds. `verify_tree_sampling` verifies one tree per call (data-dependent control flow), about
0.1-0.3 ms per call on this shared machine including building the tree (the emitted token's
`torch.multinomial` alone is up to 0.1 ms), so the library runs ROUNDS = 25 000 rounds per
configuration (3-7 s each). p0 is made concentrated enough that the sampling noise of the
position-0 TV at that size is asserted to be < 0.0045, so the 0.01 bound is meaningful. The
negative controls are test code written batched over rounds and run the full 100 000 rounds:
for a star (all children of the root) whose siblings share one q row or are fixed, the
residuals r_k do not depend on which tokens were drawn, so a whole round is a few vectorised
operations. A correct batched reference must pass the same test and each broken variant
(always-accept, resample from p instead of the residual, residual not clamped at zero, rejected
deterministic token not zeroed) must fail it.

Configurations (vocab, temperature, mask, tree):
  v10-star3-top        V=10,   T=1.0,                 root + 3 deterministic top-3 children
  v10-star3-iid        V=10,   T=0.5,                 root + 3 i.i.d. children
  v10-depth3-mixed     V=10,   T=1.5, top-k 6,        depth-3 tree: top-1 + i.i.d. siblings
  v1000-star3-top      V=1000, T=1.0, top-k 20,       top-1, top-2 and a masked token
  v1000-depth2-iid     V=1000, T=1.0, top-p 0.9,      depth-2 tree of i.i.d. children
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from distribution import (
    chi2_sf,
    chi2_stat,
    clamped_residual,
    goodness_of_fit,
    p_itself,
    tv_noise,
    unclamped_residual,
)
from specfork.config import SamplingParams
from specfork.sampling import keyed_uniform, probabilities, sample_at
from specfork.tree import Tree, chain, children
from specfork.verify import Verdict, one_hot_q, verify_greedy, verify_sampling
from specfork.verify.keyed import verify_keyed
from specfork.verify.tree import (
    verify_tree_greedy,
    verify_tree_sampling,
    verify_tree_typical,
)

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHA = 1e-3  # chi-square p-value below which a distribution test fails
TV_MAX = 0.01  # total-variation bound at position 0
SIGMAS = 5.0  # tolerance of the acceptance rate, in binomial standard deviations
ROUNDS = 25_000  # library rounds per configuration (see the module docstring)
CONTROL_ROUNDS = 100_000  # rounds per batched control
MIN_ROUNDS = 1_000  # a position is tested when at least this many rounds reached it


def logits_with_argmax(argmax: list[int], vocab: int = 12, seed: int = 0) -> torch.Tensor:
    """Random logits [len(argmax), vocab] whose row i has its maximum at argmax[i]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(argmax), vocab, generator=g)  # [R, V]
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return logits


# Rows: 0 root, 1 node0 (3), 2 node1 (5), 3 node2 (1), 4 node3 (2), 5 node4 (7), 6 node5 (6).
#   root ─ 0:3 ─ 2:1 ─ 4:7
#        │     └ 3:2
#        └ 1:5 ─ 5:6
UNEVEN = Tree(torch.tensor([3, 5, 1, 2, 7, 6]), torch.tensor([-1, -1, 0, 0, 2, 1]))


# ------------------------------------------------------------------------------ greedy


def test_greedy_first_child_path_to_a_leaf_then_bonus():
    target = logits_with_argmax([3, 1, 0, 7, 0, 4, 0])
    assert verify_tree_greedy(UNEVEN, target) == Verdict([0, 2, 4], [3, 1, 7, 4])


def test_greedy_a_later_fork_wins():
    target = logits_with_argmax([5, 0, 6, 0, 0, 0, 9])
    verdict = verify_tree_greedy(UNEVEN, target)
    assert verdict == Verdict([1, 5], [5, 6, 9])
    assert verdict.accepted == 2


def test_greedy_second_child_of_a_node():
    target = logits_with_argmax([3, 2, 0, 0, 11, 0, 0])  # node0's second child (2) matches
    assert verify_tree_greedy(UNEVEN, target) == Verdict([0, 3], [3, 2, 11])


def test_greedy_no_child_accepted_emits_the_target_token():
    target = logits_with_argmax([9, 1, 6, 7, 0, 4, 0])
    verdict = verify_tree_greedy(UNEVEN, target)
    assert verdict == Verdict([], [9])
    assert verdict.accepted == 0


def test_greedy_stops_inside_the_tree():
    target = logits_with_argmax([3, 4, 6, 7, 0, 4, 0])  # node0 accepted, none of its children
    assert verify_tree_greedy(UNEVEN, target) == Verdict([0], [3, 4])


def test_greedy_empty_tree_and_duplicate_siblings():
    assert verify_tree_greedy(chain([]), logits_with_argmax([4])) == Verdict([], [4])
    dup = Tree(torch.tensor([2, 2, 8]), torch.tensor([-1, -1, 1]))  # the first 2 wins
    target = logits_with_argmax([2, 5, 8, 1])
    assert verify_tree_greedy(dup, target) == Verdict([0], [2, 5])


def test_greedy_on_a_chain_agrees_with_verify_greedy():
    g = torch.Generator().manual_seed(1)
    vocab = 5  # small, so that drafts often agree with the target for a while
    for _ in range(200):
        k = int(torch.randint(0, 6, (1,), generator=g))
        logits = torch.randn(k + 1, vocab, generator=g)  # [K + 1, V]
        draft = logits[:k].argmax(-1)  # [K] agrees everywhere, then corrupt some positions
        flip = torch.rand(k, generator=g) < 0.25
        draft = torch.where(flip, torch.randint(0, vocab, (k,), generator=g), draft)
        chain_verdict = verify_greedy(draft, logits)
        tree_verdict = verify_tree_greedy(chain(draft), logits)
        assert tree_verdict.accepted == chain_verdict.accepted
        assert tree_verdict.tokens == chain_verdict.tokens
        assert tree_verdict.path == list(range(chain_verdict.accepted))


def test_wrong_row_counts_are_rejected():
    with pytest.raises(ValueError, match="N \\+ 1"):
        verify_tree_greedy(UNEVEN, torch.zeros(6, 12))
    with pytest.raises(ValueError, match="N \\+ 1"):
        verify_tree_sampling(UNEVEN, torch.zeros(6, 12), None, torch.Generator())
    with pytest.raises(ValueError, match="q must be"):
        p = torch.full((7, 12), 1 / 12)
        verify_tree_sampling(UNEVEN, p, torch.zeros(7, 12), torch.Generator())


# ------------------------------------------------------------------------- typical (lossy)


def test_typical_with_tiny_epsilon_accepts_everything_plausible():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(7, 12, generator=g), -1)  # every token has p > 1e-9
    verdict = verify_tree_typical(UNEVEN, p, epsilon=1e-9, delta=0.3)
    assert verdict.path == [0, 2, 4]  # the deepest leaf
    assert verdict.tokens == [3, 1, 7, int(p[5].argmax())]  # then the argmax at node4's row
    p[1, 1] = 0.0  # node2 (token 1, checked at node0's row 1) impossible, and its subtree
    verdict = verify_tree_typical(UNEVEN, p, epsilon=1e-9, delta=0.3)
    assert verdict.path == [0, 3]  # ties at depth 2 ([0, 3] and [1, 5]): depth-first order
    assert verdict.tokens == [3, 2, int(p[4].argmax())]


def test_typical_ties_break_in_depth_first_order_not_index_order():
    tree = Tree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, -1, 1, 0]))  # node 3 under node 0
    p = torch.full((5, 6), 1 / 6)
    verdict = verify_tree_typical(tree, p, epsilon=1e-3, delta=0.3)
    assert verdict.path == [0, 3]


def test_typical_threshold_uses_entropy():
    # uniform over 4 tokens: H = ln 4, delta * exp(-H) = 0.3 / 4 = 0.075 < epsilon = 0.09
    tree = Tree(torch.tensor([0]), torch.tensor([-1]))
    p = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 1.0, 0.0]])
    assert verify_tree_typical(tree, p, 0.09, 0.3) == Verdict([0], [0, 2])
    # threshold min(epsilon, delta / 4): 0.25 passes below it, fails at or above it
    assert verify_tree_typical(tree, p, 1.0, 1.2) == Verdict([], [0])  # min(1, 0.3)
    assert verify_tree_typical(tree, p, 0.2, 1.2) == Verdict([0], [0, 2])  # min(0.2, 0.3)
    assert verify_tree_typical(tree, p, 0.3, 2.0) == Verdict([], [0])  # min(0.3, 0.5)


def test_typical_with_a_one_hot_target_equals_greedy():
    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        n = int(torch.randint(0, 8, (1,), generator=g))
        parents = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]
        tokens = torch.randint(0, 4, (n,), generator=g)
        tree = Tree(tokens, torch.tensor(parents, dtype=torch.long))
        logits = torch.randn(n + 1, 4, generator=g)
        expected = verify_tree_greedy(tree, logits)
        if len({tuple(t) for t in zip(tokens.tolist(), parents, strict=True)}) == n:  # a trie
            p = probabilities(logits, greedy)  # one-hot
            assert verify_tree_typical(tree, p, epsilon=0.5, delta=2.0) == expected


def test_typical_validates_its_parameters():
    p = torch.full((1, 3), 1 / 3)
    for epsilon, delta in [(0.0, 0.3), (1.5, 0.3), (0.1, 0.0), (0.1, -1.0)]:
        with pytest.raises(ValueError):
            verify_tree_typical(chain([]), p, epsilon, delta)


# -------------------------------------------------------------------- sampling: unit tests


def test_sampling_on_a_chain_equals_verify_sampling():
    """Same random numbers, same float32 arithmetic: identical verdicts seed by seed."""
    g = torch.Generator().manual_seed(2)
    vocab = 6
    for seed in range(300):
        k = seed % 5
        p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 2, -1)  # [K + 1, V]
        q = torch.softmax(torch.randn(k, vocab, generator=g) * 2, -1)  # [K, V]
        draft = torch.multinomial(q, 1, generator=g).flatten() if k else torch.zeros(0).long()
        for q_tree, q_chain in [(q, q), (None, one_hot_q(draft, vocab))]:
            want = verify_sampling(draft, p, q_chain, torch.Generator().manual_seed(seed))
            got = verify_tree_sampling(chain(draft), p, q_tree, torch.Generator().manual_seed(seed))
            assert (got.accepted, got.tokens) == (want.accepted, want.tokens)
            assert got.path == list(range(got.accepted))


def test_sampling_follows_certain_targets():
    # p is one-hot: exactly the matching child is accepted, whatever its place among siblings
    p = torch.zeros(7, 12)
    p[0, 5], p[2, 6], p[6, 0] = 1.0, 1.0, 1.0
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert verify_tree_sampling(UNEVEN, p, None, g) == Verdict([1, 5], [5, 6, 0])
    p[0] = 0.0
    p[0, 4] = 1.0  # no child drafted 4: every child is rejected, 4 is emitted
    for _ in range(20):
        assert verify_tree_sampling(UNEVEN, p, None, g) == Verdict([], [4])


def test_sampling_a_rejected_deterministic_child_is_never_emitted_after_rejection():
    # p0 puts 0.3 on the only child's token; on rejection the residual has it zeroed
    p = torch.tensor([[0.3, 0.7, 0.0], [1.0, 0.0, 0.0]])
    tree = Tree(torch.tensor([0]), torch.tensor([-1]))
    g = torch.Generator().manual_seed(0)
    verdicts = [verify_tree_sampling(tree, p, None, g) for _ in range(400)]
    assert {tuple(v.tokens) for v in verdicts} == {(0, 0), (1,)}
    assert all(v.path == [0] for v in verdicts if v.tokens[0] == 0)


def test_sampling_with_a_residual_summing_to_zero_falls_back():
    # p <= q everywhere (p is q scaled by 1/2, as a rounding artefact would be in the extreme):
    # a rejection leaves max(0, p - q) = 0; the verifier draws from r instead of dividing by 0
    q = torch.tensor([[0.5, 0.5, 0.0]])
    p = torch.tensor([[0.25, 0.25, 0.0], [0.0, 0.0, 1.0]])
    tree = Tree(torch.tensor([1]), torch.tensor([-1]))
    g = torch.Generator().manual_seed(0)
    verdicts = [verify_tree_sampling(tree, p, q, g) for _ in range(200)]
    assert {tuple(v.tokens) for v in verdicts} <= {(1, 2), (0,), (1,)}
    assert any(v.accepted == 0 for v in verdicts)


def test_sampling_is_reproducible_with_a_seed():
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(7, 12, generator=g), -1)

    def run(seed: int) -> list[Verdict]:
        gen = torch.Generator().manual_seed(seed)
        return [verify_tree_sampling(UNEVEN, p, None, gen) for _ in range(100)]

    assert run(7) == run(7)
    assert run(7) != run(8)


# ------------------------------------------------------------------ statistical machinery


@dataclass(frozen=True)
class World:
    """Bigram target and drafter over V tokens, as rows [1 + V, V] indexed by context:
    row 0 = the root (p0, q0), row y + 1 = after token y (P[y], Q[y])."""

    p_rows: torch.Tensor  # [1 + V, V]
    q_rows: torch.Tensor  # [1 + V, V]

    @property
    def vocab(self) -> int:
        return self.p_rows.shape[1]

    @property
    def p0(self) -> torch.Tensor:
        return self.p_rows[0]  # [V]

    @property
    def P(self) -> torch.Tensor:
        return self.p_rows[1:]  # [V, V]

    @property
    def q0(self) -> torch.Tensor:
        return self.q_rows[0]  # [V]


def make_world(vocab: int, params: SamplingParams, scale: float, drift: float, seed: int) -> World:
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(vocab + 1, vocab, generator=g) * scale  # [1 + V, V]
    draft_logits = target_logits + torch.randn(vocab + 1, vocab, generator=g) * drift
    return World(probabilities(target_logits, params), probabilities(draft_logits, params))


IID = -1  # node kind: drawn from the drafter at its parent; k >= 0: the drafter's rank-k token


@dataclass(frozen=True)
class Config:
    """One distribution-test setting: vocabulary, sampling transforms, tree shape."""

    name: str
    vocab: int
    params: SamplingParams
    parents: tuple[int, ...]
    kinds: tuple[int, ...]  # IID or a rank, per node
    scale: float = 1.0  # std of the target logits (larger = more concentrated p)
    drift: float = 1.0  # std of the noise turning target logits into draft logits
    seed: int = 0

    def world(self) -> World:
        return make_world(self.vocab, self.params, self.scale, self.drift, self.seed)


def draft_trees(cfg: Config, world: World, rounds: int, gen: torch.Generator) -> torch.Tensor:
    """Tokens [R, N] of `rounds` trees of cfg's shape, drafted from the bigram drafter."""
    n = len(cfg.parents)
    tokens = torch.empty(rounds, n, dtype=torch.long)  # [R, N]
    ranks = world.q_rows.argsort(-1, descending=True)  # [1 + V, V]
    for i, (parent, kind) in enumerate(zip(cfg.parents, cfg.kinds, strict=True)):
        context = torch.zeros(rounds, dtype=torch.long) if parent < 0 else tokens[:, parent] + 1
        if kind >= 0:
            tokens[:, i] = ranks[context, kind]
            continue
        for c in context.unique().tolist():  # i.i.d. draws from the drafter at the parent
            rows = (context == c).nonzero().flatten()
            draws = torch.multinomial(world.q_rows[c], rows.numel(), True, generator=gen)
            tokens[rows, i] = draws
    return tokens


def run_library(
    cfg: Config, world: World, rounds: int, seed: int, verifier=verify_tree_sampling
) -> torch.Tensor:
    """Verify `rounds` drafted trees with `verifier`: emitted tokens [R, D + 1], -1 padded."""
    vocab, n = world.vocab, len(cfg.parents)
    parents = torch.tensor(cfg.parents, dtype=torch.long)  # [N]
    deterministic = torch.tensor([k >= 0 for k in cfg.kinds])  # [N]
    drafts = draft_trees(cfg, world, rounds, torch.Generator().manual_seed(seed))  # [R, N]
    # Row of every input position in world.p_rows: 0 for the root, y + 1 after token y.
    p_index = torch.cat([torch.zeros(rounds, 1, dtype=torch.long), drafts + 1], 1)  # [R, 1 + N]
    # q of every node as a row of q_table: the drafter at the node's parent (its parent's row
    # in world.q_rows) for drawn nodes, one-hot(token) (row 1 + V + token) for fixed ones.
    q_table = torch.cat([world.q_rows, torch.eye(vocab)])  # [1 + 2V, V]
    at_parent = torch.where(parents >= 0, drafts[:, parents.clamp_min(0)] + 1, 0)  # [R, N]
    q_index = torch.where(deterministic, 1 + vocab + drafts, at_parent)  # [R, N]
    all_det = bool(deterministic.all())
    depth = max(len(_path_to(cfg.parents, i)) for i in range(n))
    gen = torch.Generator().manual_seed(seed + 1)
    draft_lists = drafts.tolist()
    emitted = []
    with torch.inference_mode():
        for r in range(rounds):
            tree = Tree(drafts[r], parents)
            q = None if all_det else q_table[q_index[r]]  # [N, V]
            verdict = verifier(tree, world.p_rows[p_index[r]], q, gen)
            assert verdict.tokens[:-1] == [draft_lists[r][i] for i in verdict.path]
            if verdict.path:  # a root-to-node path
                assert verdict.path == _path_to(cfg.parents, verdict.path[-1])
            emitted.append(verdict.tokens + [-1] * (depth + 1 - len(verdict.tokens)))
    return torch.tensor(emitted)  # [R, D + 1]


def _path_to(parents: tuple[int, ...], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def root_acceptance(p0: torch.Tensor, q_rows: list[torch.Tensor]) -> float:
    """Exact probability that one of the root's children is accepted.

    q_rows are the siblings' q in order (a fixed token's is one-hot); the residual r_k seen by
    sibling k does not depend on which tokens earlier siblings drew.
    """
    r, none = p0.double(), 1.0
    for q in q_rows:
        q = q.double()
        none *= 1 - float(torch.minimum(r, q).sum())
        residual = (r - q).clamp_min(0)
        r = residual / residual.sum() if residual.sum() > 0 else r
    return 1 - none


@dataclass
class Report:
    """Measurements of the distribution test; `failures()` lists what is out of bounds."""

    pvalues: list[float]  # chi-square per emitted position reached by enough rounds
    tv0: float
    accept_z: float  # (measured - exact) / sigma of the root's acceptance rate

    def failures(self) -> list[str]:
        out = [
            f"position {j}: chi-square p = {pv:.2e}"
            for j, pv in enumerate(self.pvalues)
            if pv < ALPHA
        ]
        if self.tv0 > TV_MAX:
            out.append(f"position 0: TV {self.tv0:.4f} > {TV_MAX}")
        if abs(self.accept_z) > SIGMAS:
            out.append(f"root acceptance off by {self.accept_z:.1f} sigma")
        return out


def check(emitted: torch.Tensor, world: World, root_q: list[torch.Tensor]) -> Report:
    """The distribution test of emitted tokens [R, D + 1] (-1 = not emitted)."""
    vocab = world.vocab
    assert (emitted[:, 0] >= 0).all()  # every round emits a token
    pvalues = [chi2_sf(*chi2_stat(torch.bincount(emitted[:, 0], minlength=vocab), world.p0))]
    for j in range(1, emitted.shape[1]):
        reached = emitted[:, j] >= 0
        if int(reached.sum()) < MIN_ROUNDS:
            break
        prev, cur = emitted[reached, j - 1], emitted[reached, j]
        stat, df = 0.0, 0
        for y in prev.unique().tolist():  # token j given token j - 1 = y is P[y]
            s, d = chi2_stat(torch.bincount(cur[prev == y], minlength=vocab), world.P[y])
            stat, df = stat + s, df + d
        pvalues.append(chi2_sf(stat, df) if math.isfinite(stat) else 0.0)
    freq0 = torch.bincount(emitted[:, 0], minlength=vocab).double() / emitted.shape[0]
    tv0 = 0.5 * float((freq0 - world.p0.double()).abs().sum())
    beta = root_acceptance(world.p0, root_q)
    rate = float((emitted[:, 1] >= 0).double().mean())
    sigma = math.sqrt(max(beta * (1 - beta), 1e-12) / emitted.shape[0])
    return Report(pvalues, tv0, (rate - beta) / sigma)


def root_q_rows(cfg: Config, world: World) -> list[torch.Tensor]:
    """q of each child of the root, in order (fixed tokens one-hot)."""
    ranks = world.q0.argsort(descending=True)
    rows = []
    for parent, kind in zip(cfg.parents, cfg.kinds, strict=True):
        if parent < 0:
            rows.append(world.q0 if kind == IID else one_hot_q(ranks[kind], world.vocab))
    return rows


# ------------------------------------------------------------ sampling: distribution tests

T1 = SamplingParams(temperature=1.0)
CONFIGS = [
    Config("v10-star3-top", 10, T1, (-1, -1, -1), (0, 1, 2), scale=2.5, seed=3),
    Config(
        "v10-star3-iid",
        10,
        SamplingParams(temperature=0.5),
        (-1, -1, -1),
        (IID,) * 3,
        scale=2.0,
        seed=4,
    ),
    Config(
        "v10-depth3-mixed",
        10,
        SamplingParams(temperature=1.5, top_k=6),
        (-1, -1, 0, 0, 1, 2, 2),
        (0, IID, 0, IID, IID, IID, IID),
        scale=5.0,
        seed=5,
    ),
    Config(
        "v1000-star3-top",
        1000,
        SamplingParams(temperature=1.0, top_k=20),
        (-1, -1, -1),
        (0, 1, 999),
        scale=5.0,
        drift=1.5,
        seed=3,
    ),
    Config(
        "v1000-depth2-iid",
        1000,
        SamplingParams(temperature=1.0, top_p=0.9),
        (-1, -1, 0, 0, 1),
        (IID,) * 5,
        scale=5.0,
        seed=0,
    ),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_sampling_output_is_distributed_as_p(cfg: Config):
    world = cfg.world()
    assert tv_noise(world.p0, ROUNDS) < 0.0045  # the TV bound is meaningful at this size
    root_q = root_q_rows(cfg, world)
    beta = root_acceptance(world.p0, root_q)
    assert 0.3 < beta < 0.95  # p and q differ: rejections and residuals are exercised
    emitted = run_library(cfg, world, ROUNDS, seed=100 + cfg.seed)
    report = check(emitted, world, root_q)
    depth = emitted.shape[1] - 1
    assert len(report.pvalues) == depth + 1  # every position, the bonus included, was tested
    assert report.failures() == []


def test_masked_deterministic_child_is_never_accepted():
    cfg = CONFIGS[3]
    world = cfg.world()
    masked = int(world.q0.argsort(descending=True)[999])
    assert world.p0[masked] == 0  # the third child is impossible under the target
    emitted = run_library(cfg, world, 2_000, seed=7)
    assert not (emitted[:, 0] == masked).any()


# ----------------------------------------------------------------------- negative controls


def batched_star(
    drafts: torch.Tensor,
    world: World,
    q_rows: list[torch.Tensor],
    gen: torch.Generator,
    residual_of=clamped_residual,
    accept_all: bool = False,
) -> torch.Tensor:
    """Verify R star trees (drafts [R, K], all children of the root) at once: emitted [R, 2].

    Same algorithm as `verify_tree_sampling` (up to the deliberate bug): sibling k sees the
    residual r_k, which depends only on the q rows, so it is computed once for all rounds.
    """
    rounds, k = drafts.shape
    rs = [world.p0]
    for q in q_rows:
        rs.append(residual_of(rs[-1], q))  # rs[k]: what sibling k (k = K: the fallback) sees
    u = torch.rand(rounds, k, generator=gen)  # [R, K]
    chosen = torch.full((rounds,), -1, dtype=torch.long)  # [R] the accepted child's token
    for j in range(k):
        x = drafts[:, j]  # [R]
        accept = u[:, j] * q_rows[j][x] < rs[j][x]  # [R]
        if accept_all:
            accept = torch.ones_like(accept)
        accept &= chosen < 0
        chosen[accept] = x[accept]
    emitted = torch.full((rounds, 2), -1, dtype=torch.long)  # [R, 2]
    none = chosen < 0
    emitted[:, 0] = chosen
    if none.any():
        emitted[none, 0] = torch.multinomial(rs[k], int(none.sum()), True, generator=gen)
    for y in chosen[~none].unique().tolist():  # the bonus token after an accepted child y
        rows = (chosen == y).nonzero().flatten()
        emitted[rows, 1] = torch.multinomial(world.P[y], rows.numel(), True, generator=gen)
    return emitted


CONTROL_CONFIGS = [
    Config("control-v10-star3-top", 10, T1, (-1, -1, -1), (0, 1, 2), scale=1.5, drift=0.7, seed=1),
    Config("control-v10-star3-iid", 10, T1, (-1, -1, -1), (IID,) * 3, scale=1.5, drift=1.5, seed=0),
    Config(
        "control-v1000-star3-iid-topk50",
        1000,
        SamplingParams(temperature=1.0, top_k=50),
        (-1, -1, -1),
        (IID,) * 3,
        scale=4.0,
        seed=0,
    ),
]
CONTROLS = {
    "always-accept": {"accept_all": True},
    "resample-from-p": {"residual_of": p_itself},  # for fixed tokens: rejected not zeroed
    "residual-unclamped": {"residual_of": unclamped_residual},
}


def control_report(cfg: Config, **bug) -> Report:
    world = cfg.world()
    assert tv_noise(world.p0, CONTROL_ROUNDS) < 0.0045
    gen = torch.Generator().manual_seed(300 + cfg.seed)
    drafts = draft_trees(cfg, world, CONTROL_ROUNDS, gen)  # [R, K]
    root_q = root_q_rows(cfg, world)
    return check(batched_star(drafts, world, root_q, gen, **bug), world, root_q)


@pytest.mark.parametrize("cfg", CONTROL_CONFIGS, ids=lambda c: c.name)
def test_batched_reference_passes_the_distribution_test(cfg: Config):
    report = control_report(cfg)
    assert len(report.pvalues) == 2
    assert report.failures() == []


@pytest.mark.parametrize("cfg", CONTROL_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("bug", list(CONTROLS))
def test_negative_controls_fail_the_distribution_test(cfg: Config, bug: str):
    report = control_report(cfg, **CONTROLS[bug])
    assert min(report.pvalues) < ALPHA  # the chi-square test detects it...
    assert report.tv0 > TV_MAX  # ...and so does the TV bound at position 0


def test_library_harness_detects_a_broken_per_call_verifier():
    """The per-call path (`run_library`) has the power too: a verifier that resamples from p
    instead of the residual fails at 5 000 rounds."""
    cfg = CONTROL_CONFIGS[1]
    world = cfg.world()

    def broken(tree: Tree, p: torch.Tensor, q: torch.Tensor, gen: torch.Generator):
        out = batched_star(tree.tokens[None], world, list(q), gen, residual_of=p_itself)[0]
        if out[1] < 0:
            return Verdict([], [int(out[0])])
        return Verdict([int((tree.tokens == out[0]).nonzero()[0])], out.tolist())

    emitted = run_library(cfg, world, 5_000, seed=400, verifier=broken)
    report = check(emitted, world, root_q_rows(cfg, world))
    assert report.pvalues[0] < ALPHA
    assert report.tv0 > TV_MAX


def test_children_order_is_the_order_tried():
    # two deterministic children with the same target mass: the first is accepted more often
    # (it is tried with r(x) = 0.4, the second only after a rejection, with 0.4 / 0.6)
    p = torch.tensor([[0.4, 0.4, 0.2], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    tree = Tree(torch.tensor([0, 1]), torch.tensor([-1, -1]))
    assert children(tree)[0] == [0, 1]
    g = torch.Generator().manual_seed(0)
    firsts = [verify_tree_sampling(tree, p, None, g).path[:1] for _ in range(3000)]
    share = sum(f == [0] for f in firsts) / 3000
    assert share == pytest.approx(0.4, abs=0.04)
    assert sum(f == [1] for f in firsts) / 3000 == pytest.approx(0.4, abs=0.04)


# ----------------------------------------------------------------------------- keyed (seeded)


def test_keyed_verification_follows_the_seeds_own_draws() -> None:
    """The verdict walks down the children equal to the target's keyed draw at each depth
    and emits the draw where none is: the tokens plain decoding with the seed emits."""
    vocab, seed, start = 12, 5, 40
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(6, vocab, generator=gen), -1)  # [N + 1, V]
    y0 = sample_at(p[0], keyed_uniform(seed, start))
    other = (y0 + 1) % vocab
    # root: children other (node 0) and y0 (node 1); node 1's children: two guesses at depth 2
    y1 = sample_at(p[2], keyed_uniform(seed, start + 1))  # row of node 1 = 2
    wrong = (y1 + 1) % vocab
    tree = Tree(torch.tensor([other, y0, wrong, y1, 0]), torch.tensor([-1, -1, 1, 1, 0]))
    verdict = verify_keyed(tree, p, seed, start)
    y2 = sample_at(p[4], keyed_uniform(seed, start + 2))  # row of node 3 (token y1), a leaf
    assert verdict.path == [1, 3] and verdict.tokens == [y0, y1, y2]
    missed = Tree(torch.tensor([other]), torch.tensor([-1]))
    assert verify_keyed(missed, p[:2], seed, start).tokens == [y0]  # nothing accepted
    empty = Tree(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    assert verify_keyed(empty, p[:1], seed, start).tokens == [y0]
    with pytest.raises(ValueError, match=r"p must be \[N \+ 1, V\] = \[2, V\]"):
        verify_keyed(missed, p, seed, start)


def test_keyed_verification_is_distributed_as_p_across_seeds() -> None:
    """Over seeds, a chain's emitted first token is distributed as p[0] whatever the draft
    (here a fixed one that is often right), and a draft token is accepted with probability
    p(x), as by rejection sampling."""
    gen = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(3, 5, generator=gen), -1)  # [K + 1, V]
    tree = chain(torch.tensor([int(p[0].argmax()), 1]))
    first = torch.zeros(5, dtype=torch.float64)
    accepted = 0
    for seed in range(8000):
        verdict = verify_keyed(tree, p, seed, 0)
        first[verdict.tokens[0]] += 1
        accepted += verdict.accepted > 0
    assert goodness_of_fit(first, p[0].double()) > 1e-3
    assert abs(accepted / 8000 - float(p[0].max())) < 0.03
