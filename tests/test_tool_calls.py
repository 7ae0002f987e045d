"""Function calling (engine/tool_calls.py): tools in the prompt, calls read from the output, the
schema a required call is constrained to."""

from __future__ import annotations

import json

import pytest

from specfork.constraint import Constraint
from specfork.engine.tool_calls import (
    Tool,
    ToolCall,
    call_schema,
    call_text,
    parse_calls,
    response_text,
    with_tools,
)
from specfork.errors import ConfigError

WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = Tool("get_time", "The time now", {"type": "object", "properties": {}})


def test_tools_go_into_the_system_message() -> None:
    user = [{"role": "user", "content": "hi"}]
    out = with_tools(user, [WEATHER])
    assert out[0]["role"] == "system" and out[1:] == user
    assert json.dumps(WEATHER.signature()) in out[0]["content"]
    assert "<tool_call>" in out[0]["content"]
    kept = with_tools([{"role": "system", "content": "Be brief."}, *user], [WEATHER, TIME])
    assert kept[0]["content"].startswith("Be brief.\n\n") and len(kept) == 2


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', None, [("get_weather", "Oslo")]),
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            "Let me check.",
            [("get_weather", "Rome"), ("get_time", None)],
        ),
        (  # cut off before the closing tag: still a whole call
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}',
            None,
            [("get_weather", "Lima")],
        ),
        ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', None, []),  # unknown
        ("<tool_call>{not json}</tool_call>", None, []),
        ("It is sunny.", None, []),
        ('{"name": "get_weather", "arguments": [1]}', None, []),
    ],
)
def test_calls_are_read_from_the_output(text: str, content: str | None, calls: list) -> None:
    got_content, got = parse_calls(text, [WEATHER, TIME])
    assert [(c.name, json.loads(c.arguments).get("city")) for c in got] == calls
    assert got_content == (content if calls else text)
    assert all(c.id.startswith("call_") for c in got)
    assert len({c.id for c in got}) == len(got)


def test_a_call_for_openai() -> None:
    call = ToolCall("get_time", "{}", id="call_1")
    assert call.to_openai() == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": "{}"},
    }


def test_earlier_calls_and_results_render_as_the_model_writes_them() -> None:
    text = call_text("get_weather", '{"city": "Oslo"}')
    assert parse_calls(text, [WEATHER])[1][0].arguments == '{"city": "Oslo"}'
    assert call_text("get_time", {}) == call_text("get_time", "{}")
    with pytest.raises(ConfigError, match="not JSON"):
        call_text("get_time", "{oops")
    assert response_text("12:00") == "<tool_response>\n12:00\n</tool_response>"


def test_the_schema_of_a_required_call_compiles() -> None:
    one = call_schema([WEATHER])
    assert one["properties"]["name"] == {"const": "get_weather"}
    both = call_schema([WEATHER, TIME])
    assert [o["properties"]["name"]["const"] for o in both["anyOf"]] == ["get_weather", "get_time"]
    assert Constraint.json_schema(both).kind == "json_schema"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"name": "has space"}, "1-64 letters"),
        ({"name": ""}, "1-64 letters"),
        ({"name": "f", "parameters": "x"}, "JSON schema object"),
        ({"name": "f", "description": 3}, "must be a string"),
    ],
)
def test_bad_tools(fields: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        Tool(**fields)
