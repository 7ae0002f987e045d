"""A starting recycle table: the target's own prediction after every single token.

A fresh `RecycleTable` knows successors only for the prompt's tokens; every round whose root
(the token the target just emitted) was never an input before drafts nothing (30-45% of the
rounds on the dev prompts). This prior fills the rows once per model: for each token id v
below `PRIOR_IDS`, the target's top-`width` next tokens after the context `PRIOR_CONTEXT` + v —
one forward per chunk of ids, every id a one-node branch below the shared context (a diagonal
mask, all at the same position). Rows seen during a request are overwritten by what the
target predicted there (the newest information wins), so the prior only fills the gaps.

Only the first `PRIOR_IDS` ids get a row: BPE and SentencePiece vocabularies are ordered by
merge rank / frequency, and on SmolLM2's dev-prompt outputs ids below 16 384 are 95% of the
tokens (below 8 192: 89%) — a third of the cost of the whole 49k vocabulary. Measured there
(context "\n"). The table is saved under the cache folder (`recycle/`), keyed by the weight
file's identity: computed once per model file.

Off by default (`recycle_prior=True` or `--recycle-prior` turns it on): it fills the trees of
rounds that would have none, which pays where extra verification rows are nearly free; what it
measured on the CPU is in docs/benchmarks.md.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specfork.atomic import atomic_file
from specfork.drafters.recycle import UNKNOWN
from specfork.host import source_digest
from specfork.models.target import TargetModel
from specfork.steps import long_step

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the computation changes
CHUNK = 1024  # ids per forward
PRIOR_IDS = 16384  # ids that get a row (the most frequent ones, see the module docstring)
PRIOR_CONTEXT = "\n"  # what precedes each id (after BOS where the tokenizer adds one)


def prior_file(folder: Path, source: Path, width: int) -> Path:
    """Where the prior of the weights at `source` lives (changes with the file)."""
    digest = source_digest(source, width, PRIOR_IDS, FORMAT)
    return folder / f"{source.stem}-prior{width}-{digest}.safetensors"


@torch.inference_mode()
def compute_prior(
    model: TargetModel, width: int, context: list[int], ids: int = PRIOR_IDS, chunk: int = CHUNK
) -> torch.Tensor:
    """[V, width] int32: row v = the model's top-`width` next tokens after context + [v].

    Rows of ids from `ids` on are unknown (-1).
    """
    vocab = model.config.vocab_size
    ids = min(ids, vocab)
    dev = model.device
    cache = model.new_cache(len(context) + chunk)
    if context:
        model.extend(context, cache)
    start = cache.length
    out = torch.full((vocab, width), UNKNOWN, dtype=torch.int32)  # [V, W]
    for first in range(0, ids, chunk):
        ids_t = torch.arange(first, min(ids, first + chunk), device=dev)  # [C]
        n = len(ids_t)
        positions = torch.full((n,), start, dtype=torch.long, device=dev)  # [C] one level
        mask = torch.eye(n, dtype=torch.bool, device=dev)  # [C, C] each id sees only itself
        hidden = model(ids_t[None], positions, cache, mask=mask)  # [1, C, D]
        cache.truncate(start)
        logits = model.logits(hidden[0])  # [C, V]
        out[first : first + n] = logits.topk(width, dim=-1).indices.to(torch.int32).cpu()
    return out


def load_or_compute(
    model: TargetModel, width: int, context: list[int], source: Path | None, folder: Path
) -> torch.Tensor:
    """The cached prior of `source`'s weights, else computed (and saved when possible)."""
    path = prior_file(folder, source, width) if source is not None and source.exists() else None
    if path is not None and path.exists():
        try:
            table = load_file(path)["prior"]
            if table.shape == (model.config.vocab_size, width):
                return table
            log.warning("recomputing the recycle prior %s: wrong shape", path)
        except (SafetensorError, OSError, KeyError) as exc:
            log.warning("recomputing the unreadable recycle prior %s: %s", path, exc)
    ids = min(PRIOR_IDS, model.config.vocab_size)
    what = f"computing the recycle prior of {ids} token ids, once per model file"
    with long_step(log, what, "about 30 s for the default model on two cores"):
        table = compute_prior(model, width, context, ids)
    if path is not None:
        _save(table, path)
    return table


def _save(table: torch.Tensor, path: Path) -> None:
    """Write atomically; a failure only logs a warning (the prior is then recomputed)."""
    try:
        with atomic_file(path) as tmp:
            save_file({"prior": table.contiguous()}, tmp)
    except OSError as exc:
        log.warning("cannot cache the recycle prior in %s (%s)", path.parent, exc)
