"""Verification of drafted trees: pure tensor functions, the papers' notation.

p is the target's distribution, q the drafter's, both after the same sampling transforms
(`sampling.probabilities`). Rows of p (and of the target's logits) are indexed like the tree's
verification input (`tree.tree_mask`): row 0 is the root (it predicts the first drafted token),
row i + 1 is node i. Rows of q are indexed by node: q[i] is the distribution node i's token was
drawn from. Every verdict is an accepted root-to-node path plus one token from the target, so
every round emits at least one token.

- Greedy: walk down from the root, following the child equal to the target's argmax; then emit
  the target's argmax at the last accepted row.
- Sampling (SpecInfer, Miao et al. 2023; EAGLE): multi-candidate rejection sampling, lossless.
- Typical (Medusa, Cai et al. 2024): LOSSY acceptance of plausible tokens; not exact sampling.
"""

from __future__ import annotations

import torch

from specfork.sampling import Sampler, argmax, sample
from specfork.tree import Tree, children, paths
from specfork.verify import Verdict


def _check_rows(tree: Tree, rows: torch.Tensor, name: str) -> None:
    if rows.dim() != 2 or rows.shape[0] != len(tree) + 1:
        raise ValueError(
            f"{name} must be [N + 1, V] = [{len(tree) + 1}, V] for a tree of {len(tree)} nodes "
            f"(row 0 = the root), got {tuple(rows.shape)}"
        )


def verify_tree_greedy(tree: Tree, target_logits: torch.Tensor) -> Verdict:
    """Greedy verification of a tree against the target's logits [N + 1, V].

    From the root, move to the first child (by node index) whose token equals the target's
    argmax at the current row; stop when no child matches and emit the argmax at the last row.
    Without duplicate siblings (a trie) this is the longest root-to-leaf prefix equal to the
    target's greedy continuation, i.e. exactly what plain greedy decoding would produce.
    """
    _check_rows(tree, target_logits, "target_logits")
    target = argmax(target_logits).tolist()  # [N + 1]
    tokens = tree.tokens.tolist()
    kids = children(tree)
    path: list[int] = []
    row = 0
    while True:
        nxt = next((c for c in kids[row] if tokens[c] == target[row]), None)
        if nxt is None:
            return Verdict(path, [*(tokens[i] for i in path), int(target[row])])
        path.append(nxt)
        row = nxt + 1


def verify_tree_sampling(
    tree: Tree,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator,
    sampler: Sampler = sample,
) -> Verdict:
    """Lossless multi-candidate speculative sampling of a tree: p [N + 1, V], q [N, V] | None.

    At the current row, with target distribution r = p[row], the children are tried in order.
    A child x drawn from q_x = q[child] is accepted with probability min(1, r(x) / q_x(x)); on
    rejection r <- normalise(max(0, r - q_x)) for the next sibling. A deterministic child (q is
    None, or a one-hot q row, `verify.one_hot_q`) has q_x = one-hot(x): it is accepted with
    probability r(x), and on rejection r(x) <- 0 and r is renormalised. An accepted child becomes
    the current row (fresh r = p[its row]); when no child is accepted (a leaf has none), the
    emitted token is drawn from r, which at an accepted leaf is the bonus token from p[leaf row].

    Exactness: every step is a speculative-sampling step of target r with draft q_x, whose
    output (the accepted x, else a draw from the residual) is distributed as r. Chaining the
    steps is exact when each sibling's token is drawn independently of its earlier siblings
    given the parent: siblings drawn i.i.d. from the same q (duplicates kept, never merged), or
    from their own q rows, or deterministic siblings (duplicates are harmless but wasted: the
    second copy has r(x) = 0). Each node's subtree must be drafted conditioned on its own path
    only. NOT exact: siblings sampled without replacement but verified with q, or q rows that
    are not the distribution the token was actually drawn from.

    Random numbers: one uniform per node is drawn up front (a node is tried at most once), then
    one draw for the emitted token, with the same float32 arithmetic as
    `verify.verify_sampling`: a chain tree gives its verdict for the same seed.
    """
    _check_rows(tree, p, "p")
    n = len(tree)
    if q is not None and (q.dim() != 2 or q.shape[0] != n or q.shape[1] != p.shape[1]):
        raise ValueError(f"q must be [N, V] = [{n}, {p.shape[1]}], got {tuple(q.shape)}")
    tokens = tree.tokens.tolist()
    kids = children(tree)
    u = torch.rand(n, generator=generator, device=p.device)  # [N] one uniform per node
    if q is not None:
        nodes = torch.arange(n, device=q.device)
        q_x = q[nodes, tree.tokens.to(q.device)]  # [N] q of each node's own token
        u = u * q_x.clamp_min(torch.finfo(q.dtype).tiny)  # [N]
    u_q = u.tolist()  # accept node c iff u_c * q_c(x) < r(x), i.e. u_c < r(x) / q_c(x)
    path: list[int] = []
    row = 0
    while True:
        r = p[row]  # [V] target distribution at the current row
        accepted = None
        for c in kids[row]:
            x = tokens[c]
            if u_q[c] < float(r[x]):  # accepted with probability min(1, r(x) / q(x))
                accepted = c
                break
            if q is None:
                residual = r.clone()
                residual[x] = 0.0  # max(0, r - one_hot(x))
            else:
                residual = (r - q[c]).clamp_min(0)  # [V]
            total = residual.sum()
            # total == 0 means r <= q_x everywhere, i.e. r == q_x (both sum to 1), where the
            # acceptance probability is 1 and a rejection has probability 0: it can only come
            # from rounding. Keeping r (the distribution the step must reproduce) is then the
            # correct limit, and it avoids dividing by zero.
            r = residual / total if total > 0 else r
        if accepted is None:
            return Verdict(path, [*(tokens[i] for i in path), int(sampler(r, generator))])
        path.append(accepted)
        row = accepted + 1


def verify_tree_typical(
    tree: Tree, p: torch.Tensor, epsilon: float = 0.09, delta: float = 0.3
) -> Verdict:
    """LOSSY typical acceptance (Medusa): accept plausible tokens, not exact sampling from p.

    A node x is acceptable when r(x) > min(epsilon, delta * exp(-H(r))), with r = p at its
    parent's row and H(r) the entropy of r in nats; a path counts up to its first unacceptable
    node. The verdict is the longest accepted path (ties: the first in depth-first order, as
    Medusa's argmax over candidate paths), then the target's argmax at its last row. Medusa
    samples that last token from the typical-truncated p instead; here it is the argmax, so the
    whole verdict is deterministic. The output is NOT distributed as p (it favours likely
    tokens); use `verify_tree_sampling` for lossless sampling. With a one-hot p (greedy
    parameters), epsilon < 1 and no duplicate siblings it equals `verify_tree_greedy`.

    epsilon in (0, 1] (Medusa's posterior_threshold), delta > 0 (posterior_alpha).
    """
    if not 0.0 < epsilon <= 1.0:
        raise ValueError(f"typical acceptance needs 0 < epsilon <= 1, got {epsilon}")
    if not delta > 0.0:
        raise ValueError(f"typical acceptance needs delta > 0, got {delta}")
    _check_rows(tree, p, "p")
    entropy = torch.special.entr(p.double()).sum(-1)  # [N + 1] nats
    threshold = (delta * torch.exp(-entropy)).clamp_max(epsilon)  # [N + 1]
    rows = tree.parents + 1  # [N] the row each node is checked against
    plausible = (p[rows, tree.tokens].double() > threshold[rows]).tolist()  # [N]
    parents = tree.parents.tolist()
    ok = [False] * len(tree)  # node and all its ancestors plausible
    for i, parent in enumerate(parents):
        ok[i] = plausible[i] and (parent < 0 or ok[parent])
    best: list[int] = []
    for candidate in paths(tree):
        n = 0
        while n < len(candidate) and ok[candidate[n]]:
            n += 1
        if n > len(best):
            best = candidate[:n]
    last_row = best[-1] + 1 if best else 0
    tokens = tree.tokens.tolist()
    return Verdict(best, [*(tokens[i] for i in best), int(argmax(p[last_row]))])
