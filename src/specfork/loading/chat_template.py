"""Chat templates rendered exactly as transformers renders them, in Jinja's sandbox.

The environment (filters, globals, the ``generation`` tag, ``namespace`` without underscore
names) follows transformers' ``render_jinja_template``; a template is compiled once per source.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar

from specfork.errors import ModelFormatError, PromptError

if TYPE_CHECKING:
    import jinja2

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# The roles a request or a batch file may give, and the role each renders as (OpenAI's
# "developer" is a system message to the templates of open models).
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@lru_cache(maxsize=16)
def compile_chat_template(source: str, origin: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_tag_extension(), jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _template_namespace()
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ModelFormatError(
            f"The chat template of {origin} is not valid Jinja: {error}"
        ) from error


def _raise_exception(message: str) -> None:
    """``raise_exception(...)`` in a template: the template rejects the messages."""
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: plain ``json.dumps``, without Jinja's HTML escaping."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """``strftime_now("%d %b %Y")`` in a template: the current local time."""
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` in a template, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _template_namespace() -> type:
    """Jinja's ``namespace`` that refuses underscore names, as transformers' does."""
    import jinja2.exceptions
    import jinja2.utils

    def check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes, got {name!r}."
            )

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as Namespace
            self, rest = args[0], args[1:]
            attributes = dict(*rest, **kwargs)
            for name in attributes:
                check(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _generation_tag_extension() -> type:
    """``{% generation %}...{% endgeneration %}``, which only marks text, rendered as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    return GenerationTag


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: no ``None`` values, reasoning aliased."""
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise PromptError(f"A chat message must be a dict, not {type(message).__name__}.")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared
