"""Verification of a seeded request's drafts: the target's own keyed draws decide.

A seeded request draws the token at sequence position t at `keyed_uniform(seed, t)`
(`specfork.sampling`): given the prefix, that token is fixed, and it is an exact sample from p
at t (the uniform is independent of everything the prefix depends on). Verifying a draft tree
is then a walk: at the current row (depth d below the round's first position t0), the target's
token is y = the inverse of p[row]'s cumulative distribution at keyed_uniform(seed, t0 + d); the
child whose token is y is accepted and the walk goes on from its row; when no child is y, y is
emitted. The verdict's tokens are exactly those plain decoding with the same seed emits, so
the output is distributed as p (lossless) and does not depend on the draft at all: trimming,
batching or another drafter change how many tokens a forward confirms, never which.

A deterministic draft x is accepted with probability p(x), as by rejection sampling; a sampled
draft is accepted when its own draw lands on y, which `sampling.draw` makes likely by drawing it
at the same keyed uniform from q (the inverse-CDF coupling of q and p).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specfork.sampling import keyed_uniform, sample_at
from specfork.tree import Tree, children
from specfork.verify import Verdict


def verify_keyed(
    tree: Tree,
    p: torch.Tensor,
    seed: int,
    start: int,
    draw_at: Callable[[torch.Tensor, float], int] = sample_at,
) -> Verdict:
    """Verify `tree` against p [N + 1, V] (row 0 = the root, row i + 1 = node i) for a request
    seeded with `seed` whose next token sits at sequence position `start`; `draw_at` is the
    inverse-CDF draw (`sampling.sample_at`, or the kernels' equal)."""
    if p.dim() != 2 or p.shape[0] != len(tree) + 1:
        raise ValueError(
            f"p must be [N + 1, V] = [{len(tree) + 1}, V] for a tree of {len(tree)} nodes, "
            f"got {tuple(p.shape)}"
        )
    tokens = tree.tokens.tolist()
    kids = children(tree)
    path: list[int] = []
    row = 0
    while True:
        y = draw_at(p[row], keyed_uniform(seed, start + len(path)))
        nxt = next((c for c in kids[row] if tokens[c] == y), None)
        if nxt is None:
            return Verdict(path, [*(tokens[i] for i in path), y])
        path.append(nxt)
        row = nxt + 1
