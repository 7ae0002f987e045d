"""Checks of what callers hand the engine: prompt elements as token ids, argument kinds,
prompt text the tokenizer can take, the Generator's own arguments. Each raises the error that
names the problem and its fix (never a TypeError or AttributeError later)."""

from __future__ import annotations

import operator
import reprlib
from collections.abc import Sequence

from specfork.checks import is_int
from specfork.config import SpecConfig
from specfork.errors import ConfigError, PromptError
from specfork.loading.loader import LoadedModel


def integer(t: object) -> int | None:
    """`t` as a token id if it is an integer of any kind (Python, NumPy, a 0-d tensor); not a
    truth value nor a one-element array."""
    if isinstance(t, bool) or getattr(t, "ndim", 0) != 0 or "bool" in str(getattr(t, "dtype", "")):
        return None
    try:
        return operator.index(t)
    except TypeError:
        return None


def as_token_ids(prompt: Sequence[object]) -> list[int] | None:
    """The ids of a prompt given as token ids; None for chat messages (dicts). PromptError
    names the first element that is neither."""
    if not prompt or any(isinstance(t, dict) for t in prompt):
        return None
    ids: list[int] = []
    for index, t in enumerate(prompt):
        i = integer(t)
        if i is None:
            raise PromptError(
                f"prompt element {index} is {reprlib.repr(t)} ({type(t).__name__}): a prompt "
                "list holds token ids (integers) or chat messages (dicts), not a mix or other "
                "values (an array of ids: pass ids.tolist())"
            )
        ids.append(i)
    return ids


def check_kind(name: str, value: object, kind: type) -> None:
    """ConfigError naming an argument of the wrong type (not an AttributeError later)."""
    if value is not None and not isinstance(value, kind):
        raise ConfigError(
            f"{name} must be a {kind.__name__} or None, got {type(value).__name__}: write "
            f"{name}={kind.__name__}(...)"
        )


def check_text(text: str) -> None:
    """PromptError for text that is not Unicode the tokenizer can take: undecodable bytes (read
    with surrogateescape, as Python reads command lines) and lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise PromptError(
            f"the prompt is not valid UTF-8 text: character {exc.start} is {bad!r} (an undecodable "
            "byte or a lone surrogate); send UTF-8 text"
        ) from None


def check_arguments(
    loaded: object,
    spec: object,
    max_context: object,
    prefill_chunk: object,
    max_strategies: object,
) -> None:
    """ConfigError naming a Generator argument of the wrong kind (not a TypeError later)."""
    if not isinstance(loaded, LoadedModel):
        raise ConfigError(
            f"Generator takes a loaded model, got {type(loaded).__name__}; "
            "write Generator(load_model(name))"
        )
    if spec is not None and not isinstance(spec, SpecConfig):
        raise ConfigError(f"spec must be a SpecConfig, got {type(spec).__name__}")
    integers = {"max_strategies": (max_strategies, 1), "prefill_chunk": (prefill_chunk, 1)}
    if max_context is not None:
        integers["max_context"] = (max_context, 2)  # a prompt token and a new one
    for name, (value, least) in integers.items():
        if not is_int(value) or value < least:
            raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
