"""What a request's output must match: a JSON schema, any JSON object, or a regular expression.

A `Constraint` is validated on construction: the schema or pattern is compiled to an llguidance
grammar and checked (no tokenizer needed), so a bad schema or a pattern llguidance refuses is a
`ConfigError` before any model runs. The engine turns it into per-token masks
(`specfork.engine.grammar`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import llguidance

from specfork.errors import ConfigError

KINDS = ("json_schema", "json_object", "regex")
ANY_OBJECT = '{"type": "object"}'
# JSON is written compact (separators ", " and ": ", no other whitespace): with free whitespace
# small models fill their whole budget with blank lines where they should close a string or
# an object, and a compact object is fewer tokens
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SOURCE_CHARS = 100_000  # a schema or pattern longer than this is refused


@dataclass(frozen=True, slots=True)
class Constraint:
    """A constraint on the output text.

    `kind` is "json_schema" (`source`: the schema as JSON text), "json_object" (any JSON
    object; `source` empty) or "regex" (`source`: the pattern, matched by the whole output).
    Build one with `json_schema`, `json_object` or `regex`.
    """

    kind: str
    source: str = ""
    grammar: str = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"unknown constraint kind {self.kind!r}; use one of {KINDS}")
        if not isinstance(self.source, str):
            raise ConfigError(f"a constraint's source must be text, got {self.source!r}")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise ConfigError(
                f"the {self.kind} is {len(self.source)} characters long; the limit is "
                f"{MAX_SOURCE_CHARS}"
            )
        object.__setattr__(self, "grammar", self._compile())

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Constraint:
        """Output valid JSON that follows `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ConfigError(f"the JSON schema is not valid JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise ConfigError(
                f"a JSON schema must be a JSON object such as {ANY_OBJECT}, got "
                f"{type(schema).__name__}"
            )
        # keys in the given order: the grammar writes an object's properties in schema order
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        """Output any valid JSON object (OpenAI's `response_format` json_object)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Output text that the regular expression `pattern` matches as a whole."""
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"a regex constraint needs a non-empty pattern, got {pattern!r}")
        return cls("regex", pattern)

    def matches(self, text: str) -> bool:
        """Whether finished output `text` satisfies the constraint's kind: JSON that parses
        (an object for json_object) or, for a regex, any text (the grammar guarantees it)."""
        if self.kind == "regex":
            return True
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return isinstance(value, dict) or self.kind == "json_schema"

    def describe(self) -> str:
        """A short label: 'json_object', 'json_schema' or 'regex /…/'."""
        if self.kind == "regex":
            short = self.source if len(self.source) <= 40 else self.source[:37] + "..."
            return f"regex /{short}/"
        return self.kind

    def _compile(self) -> str:
        """The llguidance grammar, checked without a tokenizer (ConfigError naming the fault)."""
        what = "regex" if self.kind == "regex" else "JSON schema"
        try:
            if self.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(self.source)
            else:
                schema = self.source or ANY_OBJECT
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, defaults=JSON_LAYOUT
                )
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"the {what} cannot be used: {_one_line(str(exc))}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
        if error:
            raise ConfigError(f"the {what} cannot be used: {_one_line(error)}")
        return grammar


def _one_line(message: str) -> str:
    """An llguidance message (sometimes several lines with a caret) as one line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "rejected by the grammar compiler"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return lines[0] if detail is None else f"{lines[0].rstrip(':')} ({detail})"
