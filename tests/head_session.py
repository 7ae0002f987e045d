"""A draft head's drafter for one request that has seen its prompt's features (tests of the
head's drafting and of cascades)."""

from __future__ import annotations

from pathlib import Path

import torch

from specfork.drafters.base import Feedback
from specfork.drafters.head import HeadDrafter
from specfork.engine.generator import Generator
from specfork.heads.model import load_head
from specfork.loading.loader import LoadedModel


def head_session(
    loaded: LoadedModel, head_dir: Path, prompt: str, root: int
) -> tuple[HeadDrafter, list[int]]:
    """The head at `head_dir` drafting for `loaded` after `prompt` (its features observed, as
    after prefill); the history: the prompt's ids and `root`, the last emitted token."""
    head = load_head(head_dir, loaded.model.config)
    ids = Generator(loaded).encode_prompt(prompt)
    session = HeadDrafter(head, loaded.model).begin(ids)
    model = loaded.model
    with torch.inference_mode():
        _, hidden = model.extend_capturing(
            ids, model.new_cache(len(ids) + 8), head.config.feature_layers
        )
    session.observe(Feedback(len(ids), torch.tensor(ids), [], None, hidden, prompt=True))
    return session, [*ids, root]
