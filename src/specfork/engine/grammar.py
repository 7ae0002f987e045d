"""A constrained request's grammar state: token masks for the target and for drafts.

Constrained plain decoding masks the target's logits at every step to the tokens the grammar
allows (−inf elsewhere), then samples or takes the argmax as usual. Speculation stays lossless
with respect to it when every verified row gets the mask of the grammar state after that row's
prefix, and drafts respect the grammar:

- `constrain(draft)` walks the draft tree depth first from the current state (consume a node's
  token, compute its row's mask, visit its children, roll back), giving the masks [N + 1, V] of
  the verification rows. A node whose token the grammar forbids can never be accepted (its
  masked p is 0), so its subtree is cut. A deterministic node (no q) is cut too: rejecting a
  one-hot proposal x with p(x) = 0 leaves p unchanged, so dropping it changes nothing. A sampled
  node (q given) is kept as a leaf: its rejection must draw from the residual max(0, p − q), as
  the drafter really sampled from q — cutting it would skew the output.
- `advance(tokens)` consumes the round's emitted tokens (accepted ones, then the target's).

Masks come from llguidance (`LLMatcher`), whose tokenizer is built once per model from the
model's `tokenizers` backend (`grammar_tokenizer`).
"""

from __future__ import annotations

import logging
import time

import llguidance
import torch

from specfork.constraint import Constraint
from specfork.drafters.base import Draft, kept_origins
from specfork.errors import ConstraintError
from specfork.loading.tokenizer import Tokenizer
from specfork.tree import children, prune

log = logging.getLogger(__name__)

_BITS = torch.arange(8, dtype=torch.uint8)  # [8] bit positions within a byte
FORCED_BYTES = 256  # forced bytes tokenized at most per round (a round drafts 16 at most)


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer (costs ~0.2 s: build once per model)."""
    backend = getattr(tokenizer, "_backend", None)
    if backend is None or not tokenizer.eos_ids:
        raise ConstraintError(
            "this model's tokenizer has no fast tokenizer or no end-of-sequence token, which "
            "constrained output needs; drop the JSON schema / regex constraint"
        )
    try:
        return llguidance.LLTokenizer(
            backend.to_str(), n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_ids)
        )
    except (ValueError, RuntimeError) as exc:
        raise ConstraintError(
            f"this model's tokenizer cannot drive a grammar ({exc}); drop the JSON schema / "
            "regex constraint"
        ) from None


class GrammarState:
    """One request's grammar matcher and the masks it gives (`vocab` = the model's logits)."""

    def __init__(
        self,
        constraint: Constraint,
        tokenizer: llguidance.LLTokenizer,
        vocab: int,
        mask_budget: float | None = None,
    ) -> None:
        self.constraint = constraint
        self.mask_budget = mask_budget  # seconds a row's mask may take on average (None: any)
        self.vocab = vocab
        self.words = (vocab + 31) // 32  # int32 words of one bitmask row
        self.matcher = llguidance.LLMatcher(tokenizer, constraint.grammar, log_level=0)
        self.tokenizer = tokenizer
        if self.matcher.is_error():
            raise ConstraintError(
                f"the {constraint.describe()} constraint cannot be compiled for this model: "
                f"{self.matcher.get_error().strip().splitlines()[0]}"
            )
        self.mask_seconds = 0.0  # time spent computing masks and walking drafts
        self.masks = 0  # rows masked
        self._first = self._first_mask(constraint)  # [1, W] the mask before any token

    def _first_mask(self, constraint: Constraint) -> torch.Tensor:
        """The first mask, computed now so that a grammar whose language is empty (it compiles,
        yet no text matches it) is refused with the request instead of failing mid-step."""
        bits = torch.zeros(1, self.words, dtype=torch.int32)  # [1, W]
        t0 = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        self._check_cost(time.perf_counter() - t0, 1)
        self.masks += 1
        if self.matcher.is_error() or not bool(bits.any()):
            raise ConstraintError(
                f"the {constraint.describe()} constraint matches no text at all (for example "
                "an empty character class such as [^\\s\\S], or a $ref that only refers to "
                "itself); fix the pattern or schema so that some text satisfies it"
            )
        return bits

    @property
    def finished(self) -> bool:
        """The grammar is complete and accepts nothing more (only an end-of-sequence)."""
        return self.matcher.is_stopped()

    def mask(self) -> torch.Tensor:
        """The tokens allowed next [V] bool."""
        t0 = time.perf_counter()
        bits, self._first = self._first, None
        if bits is None:
            bits = torch.zeros(1, self.words, dtype=torch.int32)  # [1, W]
            self._fill(bits, 0)
        allowed = self._unpack(bits)[0]
        self._spent(time.perf_counter() - t0)
        return allowed

    def constrain(self, draft: Draft) -> tuple[Draft, torch.Tensor]:
        """The draft without nodes the grammar rules out (see the module docstring), and the
        allowed tokens [N' + 1, V] bool at its verification rows (row 0: the root)."""
        t0 = time.perf_counter()
        n = len(draft)
        bits = torch.full((n + 1, self.words), -1, dtype=torch.int32)  # [N + 1, W]
        self._fill(bits, 0)
        keep = [False] * n
        if n:
            self._walk(draft, bits, keep)
        result = (draft, self._unpack(bits)) if all(keep) else self._pruned(draft, bits, keep)
        self._spent(time.perf_counter() - t0)
        return result

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (llguidance's fast-forward tokens: the
        bytes every continuation starts with, tokenized as the model's tokenizer would), or []
        when the next token is open (or the grammar is complete)."""
        if limit < 1 or self.matcher.is_stopped():
            return []
        t0 = time.perf_counter()
        # the forced bytes first: ~2 µs where the next byte is open (most steps), against
        # ~15 µs for tokenizing them; the parser's work is shared with the next mask
        forced = self.matcher.compute_ff_bytes()
        if len(forced) <= FORCED_BYTES:
            tokens = self.matcher.compute_ff_tokens() if forced else []
        else:  # a long literal (6 ms a round for 20 kB): a prefix, less its maybe cut last token
            tokens = self.tokenizer.tokenize_bytes(forced[:FORCED_BYTES])[:-1]
        self.mask_seconds += time.perf_counter() - t0
        return tokens[:limit]

    def advance(self, tokens: list[int]) -> list[int]:
        """Consume a round's emitted tokens (each one the masks allowed); returns them up to
        the one that completes the grammar (nothing may follow it)."""
        self._first = None
        for i, token in enumerate(tokens):
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused emitted token {token}: {self._error()}")
            if self.matcher.is_stopped():
                return tokens[: i + 1]
        return tokens

    # -- internals ----------------------------------------------------------------------------
    def _spent(self, seconds: float) -> None:
        self.mask_seconds += seconds
        self._check_cost(self.mask_seconds, self.masks)

    def _check_cost(self, seconds: float, rows: int) -> None:
        """ConstraintError when masking costs more than the budget per row: the first mask
        alone, later the mean over every row so far (one slow row among many is no reason)."""
        if self.mask_budget is None or rows < 1 or seconds / rows <= self.mask_budget:
            return
        raise ConstraintError(
            f"the {self.constraint.describe()} constraint costs {1000 * seconds / rows:.1f} ms "
            f"to enforce per token, over the limit of {1000 * self.mask_budget:g} ms "
            "(max_mask_ms); large repetition counts such as x{100000} or minLength 100000 cost "
            "this: use smaller bounds"
        )

    def _walk(self, draft: Draft, bits: torch.Tensor, keep: list[bool]) -> None:
        """Depth first over the tree: consume, mask, recurse, roll back (row r = node r - 1)."""
        tokens, parents = draft.tokens.tolist(), draft.tree.parents.tolist()
        kids = children(draft.tree)
        sampled = self._keeps_forbidden(draft)
        stack: list[tuple[int, int]] = [(c, 0) for c in reversed(kids[0])]  # (node, depth)
        depth = 0  # tokens consumed beyond the root state
        while stack:
            node, node_depth = stack.pop()
            if depth > node_depth:
                self.matcher.rollback(depth - node_depth)
                depth = node_depth
            parent_row = parents[node] + 1
            token = tokens[node]
            if not _allowed(bits, parent_row, token):
                keep[node] = sampled  # a sampled node stays, as a leaf that is always rejected
                continue
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused an allowed token: {self._error()}")
            depth += 1
            keep[node] = True
            self._fill(bits, node + 1)
            stack.extend((c, node_depth + 1) for c in reversed(kids[node + 1]))
        if depth:
            self.matcher.rollback(depth)

    @staticmethod
    def _keeps_forbidden(draft: Draft) -> bool:
        """Whether forbidden nodes stay as leaves: when their tokens were sampled from q."""
        return draft.q is not None

    def _pruned(
        self, draft: Draft, bits: torch.Tensor, keep: list[bool]
    ) -> tuple[Draft, torch.Tensor]:
        tree, index = prune(draft.tree, torch.tensor(keep, dtype=torch.bool))
        kept = index >= 0  # [N]
        rows = torch.cat([torch.tensor([True]), kept.cpu()])  # [N + 1] the root stays
        q = None if draft.q is None else draft.q[kept.to(draft.q.device)]
        scores = None if draft.scores is None else draft.scores[kept.to(draft.scores.device)]
        pruned = Draft(tree, q, scores, draft.forwards, draft.source, kept_origins(draft, kept))
        return pruned, self._unpack(bits[rows])

    def _fill(self, bits: torch.Tensor, row: int) -> None:
        words = bits[row]  # [W] int32, contiguous: a row of a contiguous tensor
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        self.masks += 1
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar matcher failed: {self._error()}")

    def _unpack(self, bits: torch.Tensor) -> torch.Tensor:
        """Bitmask rows [R, W] int32 → allowed tokens [R, V] bool (bit t of the row = token t)."""
        as_bytes = bits.contiguous().view(torch.uint8)  # [R, 4W], little-endian words
        flat = (as_bytes.unsqueeze(-1) >> _BITS) & 1  # [R, 4W, 8]
        return flat.view(bits.shape[0], -1)[:, : self.vocab].bool()  # [R, V]

    def _error(self) -> str:
        return self.matcher.get_error() or "no error message"


def _allowed(bits: torch.Tensor, row: int, token: int) -> bool:
    """Whether bitmask row `row` allows `token`."""
    return bool((int(bits[row, token >> 5]) >> (token & 31)) & 1)
