"""Function calling on any chat model: tools described in the prompt, calls read from the output.

The tools go into the system message in the Hermes format that open chat models are trained on
(Qwen 2.5, Hermes, SmolLM2's function-calling data): a `<tools>` block of JSON signatures and
the instruction to answer a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
Earlier calls and their results are written back the same way (`<tool_call>` in the assistant's
turn, `<tool_response>` in a user turn), so a conversation with tools renders with any chat
template. When a call is required (OpenAI's `tool_choice: "required"` or a named function), the
output is constrained to the JSON of one call (`call_schema`): it is a valid call by
construction, under any strategy, since constraints apply to target and drafts alike.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specfork.errors import ConfigError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
INSTRUCTIONS = (
    "You may call one or more functions to assist with the user query. The function "
    "signatures are within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
    "function call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ConfigError(
                f"a tool's name is 1-64 letters, digits, '_' or '-', got {self.name!r}"
            )
        if not isinstance(self.description, str):
            raise ConfigError(f"the description of tool {self.name} must be a string")
        if not isinstance(self.parameters, dict):
            raise ConfigError(f"the parameters of tool {self.name} must be a JSON schema object")

    def signature(self) -> dict[str, Any]:
        """OpenAI's tool object (what the prompt lists)."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: an id, the function's name, its arguments as JSON text."""

    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def with_tools(messages: list[dict[str, str]], tools: Sequence[Tool]) -> list[dict[str, str]]:
    """The messages with the tools' description in the system message (added first, or
    appended to the one there is)."""
    listed = "\n".join(json.dumps(t.signature(), ensure_ascii=False) for t in tools)
    text = INSTRUCTIONS.format(tools=listed)
    if messages and messages[0]["role"] == "system":
        first = {"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def call_text(name: str, arguments: Any) -> str:
    """An earlier call as the assistant wrote it (`arguments`: an object or its JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ConfigError(
                f"the arguments of the call to {name} are not JSON: {arguments[:80]!r}"
            ) from None
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def response_text(content: str) -> str:
    """A tool's result as the next user turn carries it."""
    return f"<tool_response>\n{content}\n</tool_response>"


def call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """The JSON schema of one call of one of `tools`: {"name": ..., "arguments": {...}}, the
    name first. Arguments hold the declared parameters only (OpenAI's strict mode) unless a
    tool's schema says otherwise: a function cannot take arguments it never named."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _closed(t.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """An object schema with declared properties and no word on others: no others."""
    if "properties" in schema and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def parse_calls(text: str, tools: Sequence[Tool]) -> tuple[str | None, list[ToolCall]]:
    """The content and the calls of an output: `<tool_call>` blocks, or an output that is
    itself one call's JSON. A block that is not a call of a known tool stays in the content."""
    known = {t.name for t in tools}
    whole = _call(text, known)
    if whole is not None:
        return None, [whole]
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in CALL_BLOCK.finditer(text):
        call = _call(match.group(1), known)
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _call(text: str, known: set[str]) -> ToolCall | None:
    """A call from JSON text {"name": ..., "arguments": {...}} naming a known tool."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in known:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
