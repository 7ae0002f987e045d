"""The drafter mini-language: sources joined by "+", each `kind` or `kind:PATH`
(`recycle+ngram`, `ngram+head:/heads/h1`, `model:org/draft`), parsed once into `DraftSource`s.

Which kinds exist, which take a PATH and which a strategy accepts is `kinds`' data; the errors
name the valid sources the way the CLI, the server and the bench's spec strings show them.
"""

from __future__ import annotations

from dataclasses import dataclass

from specfork.catalog.kinds import (
    CHAIN_DRAFTERS,
    STRATEGY_KINDS,
    TREE_SOURCES,
    DrafterKind,
    StrategyKind,
    drafter_kind,
)
from specfork.errors import ConfigError

JOIN = "+"  # joins the sources of one drafter string
PATH_MARK = ":"  # separates a kind from its PATH


@dataclass(frozen=True, slots=True)
class DraftSource:
    """One source of a drafter: a drafter kind (`kinds.DRAFTER_KINDS`) and its PATH, None
    where it has none (a head without one is the head shipped for the target). `str()` writes
    it back as the user would: `"+".join(map(str, sources))` parses to the same sources."""

    kind: str
    path: str | None = None

    def __post_init__(self) -> None:
        found = drafter_kind(self.kind) if isinstance(self.kind, str) else None
        if found is None:
            raise ConfigError(f"unknown drafter kind {self.kind!r}")
        path = self.path
        if path is not None and (not isinstance(path, str) or not path or JOIN in path):
            raise ConfigError(f"a drafter PATH is a non-empty string without '+', got {path!r}")
        if (path is None and found.path == "required") or (path and found.path == "none"):
            raise ConfigError(f"drafter {self.kind!r} is written {found.usage}, got path {path!r}")

    def __str__(self) -> str:
        return self.kind if self.path is None else f"{self.kind}{PATH_MARK}{self.path}"


def parse_drafter(text: object, strategy: StrategyKind) -> tuple[DraftSource, ...]:
    """The sources of a drafter string for `strategy`, in the order given; ConfigError for a
    non-string, a source `strategy` does not accept (or an unknown one) and a source named
    twice."""
    if not isinstance(text, str):
        raise ConfigError(f"drafter must be a string such as 'ngram', got {text!r}")
    sources = tuple(_source(part, strategy) for part in text.split(JOIN))
    if len(set(sources)) < len(sources):
        raise ConfigError(f"drafter {text!r} names a source twice; name each once")
    return sources


def join_sources(sources: tuple[DraftSource, ...]) -> str:
    """The drafter string of `sources` (parse_drafter's inverse)."""
    return JOIN.join(str(s) for s in sources)


def _source(text: str, strategy: StrategyKind) -> DraftSource:
    name, mark, path = text.partition(PATH_MARK)
    kind = drafter_kind(name)
    if kind is None or not strategy.accepts(kind) or not _path_fits(kind, mark, path):
        raise ConfigError(_unknown(text, kind, strategy))
    return DraftSource(name, path or None)


def _path_fits(kind: DrafterKind, mark: str, path: str) -> bool:
    """`kind:PATH` for a kind that takes one (`head:` is the shipped head, like `head`)."""
    if kind.path == "none":
        return not mark
    return bool(path) if kind.path == "required" else True


def _unknown(text: str, kind: DrafterKind | None, strategy: StrategyKind) -> str:
    if kind is not None and strategy.accepts(kind):  # a known source, its PATH wrong
        takes = {"none": "takes no PATH", "required": "needs a PATH"}.get(kind.path, "")
        return f"drafter {text!r}: {kind.name} is written {kind.usage} ({takes or 'PATH'})"
    if strategy.tree:
        return (
            f"unknown {strategy.name} drafter {text!r}; use one or more of "
            f"{', '.join(TREE_SOURCES)} joined by '+', e.g. recycle+ngram"
        )
    hint = ""
    if kind is not None and not kind.chain:
        trees = " or ".join(s.name for s in STRATEGY_KINDS if s.tree and s.accepts(kind))
        hint = f" ({kind.name} drafts trees: strategy {trees})"
    return (
        f"unknown drafter {text!r}; choose one of {', '.join(CHAIN_DRAFTERS)}, or several "
        f"joined by '+' and asked in order (e.g. ngram+head){hint}"
    )
