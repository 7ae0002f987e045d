"""`specfork serve`: the OpenAI-compatible server, driven by the real `openai` client and httpx.

One server on the real default model (float32, CPU, 1024-token context) is started per module on
a free loopback port; greedy output through it must equal the library's `Generator.generate`.
Scheduling (queue full, load shedding, internal errors) is tested on small apps whose engine is a
fake that blocks until the test lets it go, so nothing depends on timing.
"""

from __future__ import annotations

import argparse
import gc
import json
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from rich.console import Console

from cli_run import run_cli
from specfork.cli import serve as serve_command
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.engine.generator import GenerationResult, Generator
from specfork.engine.stats import GenerationStats
from specfork.engine.thread import model_thread, run_in
from specfork.errors import SpecforkError
from specfork.loading.loader import LoadedModel
from specfork.models.cost import CostCurve
from specfork.server.app import create_app
from specfork.server.run import serve_in_background

MODEL = "smollm2-135m-instruct"
CONTEXT = 1024
N_TOKENS = 12
PROMPT = "Repeat exactly: one two three, one two three, one two three,"
MESSAGES = [{"role": "user", "content": "List the numbers one to five, then again."}]
STRATEGIES = {
    "ar": None,
    "ngram": {"strategy": "speculative", "drafter": "ngram", "k": 3},
    "dspark": {"strategy": "dspark", "drafter": "ngram"},
    "spork": {"strategy": "spork", "drafter": "recycle+ngram"},
}
# the servers' goodput gates and batch allocation price rows by this CPU-like curve, not by the
# model's timed one: what they draft (and so what they accept) does not depend on the machine
CURVE = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.25, 1.5, 2.3, 3.9, 6.8))


@dataclass
class Served:
    url: str
    client: openai.OpenAI
    reference: Generator  # a second Generator on the same weights, used while the server idles


@pytest.fixture(scope="module")
def served(smollm_f32: LoadedModel) -> Iterator[Served]:
    generator = Generator(smollm_f32, max_context=CONTEXT, cost_curve=CURVE)
    app = create_app(generator, model_name=MODEL, queue_size=64)
    with serve_in_background(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield Served(url, client, Generator(smollm_f32, max_context=CONTEXT, cost_curve=CURVE))
        client.close()


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}


def _spec(name: str) -> SpecConfig | None:
    obj = STRATEGIES[name]
    return None if obj is None else SpecConfig(**obj)


def _extra(name: str) -> dict:
    extra: dict = {"ignore_eos": True}
    if STRATEGIES[name] is not None:
        extra["speculative"] = STRATEGIES[name]
    return extra


def _metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _until(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll until `predicate` holds (the deadline only guards against a hang)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- greedy output equals the library's ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_matches_library(served: Served, strategy: str, stream: bool) -> None:
    kwargs = dict(
        model=MODEL, prompt=PROMPT, max_tokens=N_TOKENS, temperature=0, extra_body=_extra(strategy)
    )
    if stream:
        chunks = list(served.client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
        stats = chunks[-1].model_extra["speculative"]
    else:
        resp = served.client.completions.create(**kwargs)
        text, finish = resp.choices[0].text, resp.choices[0].finish_reason
        stats = resp.model_extra["speculative"]
        assert resp.usage.completion_tokens == N_TOKENS
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + N_TOKENS
    config = GenerationConfig(max_new_tokens=N_TOKENS, ignore_eos=True)
    ref = served.reference.generate(PROMPT, chat=False, config=config, spec=_spec(strategy))
    assert (text, finish) == (ref.text, ref.finish_reason) == (ref.text, "length")
    assert stats["strategy"] == ("ar" if strategy == "ar" else STRATEGIES[strategy]["strategy"])
    assert stats["drafted"] == ref.stats.drafted and stats["accepted"] == ref.stats.accepted
    if strategy == "ngram":
        assert stats["drafter"] == "ngram" and stats["k"] == 3 and stats["accepted"] > 0
        assert stats["mean_accepted_length"] > 1


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_matches_library(served: Served, strategy: str, stream: bool) -> None:
    kwargs = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=N_TOKENS,
        temperature=0,
        extra_body=_extra(strategy),
    )
    if stream:
        chunks = list(
            served.client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = chunks[-2].choices[0].finish_reason
        usage = chunks[-1].usage
        assert chunks[-1].choices == []
    else:
        resp = served.client.chat.completions.create(**kwargs)
        assert resp.object == "chat.completion" and resp.choices[0].message.role == "assistant"
        text, finish, usage = (
            resp.choices[0].message.content,
            resp.choices[0].finish_reason,
            resp.usage,
        )
    config = GenerationConfig(max_new_tokens=N_TOKENS, ignore_eos=True)
    ref = served.reference.generate(MESSAGES, chat=True, config=config, spec=_spec(strategy))
    assert (text, finish) == (ref.text, "length")
    assert usage.completion_tokens == N_TOKENS
    assert usage.prompt_tokens == len(ref.prompt_ids)


@pytest.mark.slow
def test_stop_string_and_eos(served: Served) -> None:
    resp = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N_TOKENS, temperature=0, stop=[" three"]
    )
    assert resp.choices[0].finish_reason == "stop"
    assert "three" not in resp.choices[0].text
    chat = served.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say only: yes"}],
        max_tokens=64,
        temperature=0,
    )
    assert chat.choices[0].finish_reason == "stop"  # EOS (<|im_end|>) before 64 tokens
    assert chat.usage.completion_tokens < 64


@pytest.mark.slow
def test_models_health_metrics(served: Served) -> None:
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(f"{served.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    probe = httpx.head(f"{served.url}/health")  # load balancers' probes may use HEAD
    assert probe.status_code == 200 and not probe.content
    text = httpx.get(f"{served.url}/metrics").text
    for name in (
        "specfork_requests_total",
        "specfork_prompt_tokens_total",
        "specfork_completion_tokens_total",
        "specfork_drafted_tokens_total",
        "specfork_accepted_tokens_total",
        "specfork_mean_accepted_length",
        "specfork_time_to_first_token_seconds_bucket",
        "specfork_request_latency_seconds_bucket",
        "specfork_queue_depth",
        "specfork_speculation_enabled",
    ):
        assert name in text, name


# -- bad input ------------------------------------------------------------------------------------

LONG = "word " * 1500
HUGE_TREE = {"strategy": "spork", "drafter": "self", "forks": 64, "depth": 64, "adapt": False}
ADAPTED_TREE = {"strategy": "spork", "forks": 9, "depth": 8}  # adapt: up to 18 × 16 = 288 nodes
LOSSY = {"strategy": "spork", "lossy_typical": True}  # the server does not allow lossy requests
BAD = [
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", b"[" * 100_000, None),
    ("completions", b"\xff\xfe", None),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": "   "}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("chat/completions", {"max_tokens": 4}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("completions", {"prompt": LONG}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("completions", {"prompt": "word " * 600, "max_tokens": 600}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    (
        "chat/completions",
        {"messages": MESSAGES, "max_completion_tokens": -1},
        "max_completion_tokens",
    ),
    ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("completions", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("completions", b'{"prompt": "hi \\ud800 there"}', None),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', None),
    ("completions", b'{"prompt": "hi", "\\ud800": 1}', None),
    ("completions", b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -2}, "top_k"),
    ("completions", {"prompt": "hi", "min_p": -0.1}, "min_p"),
    ("completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("completions", {"prompt": "hi", "seed": -3}, "seed"),
    ("completions", {"prompt": "hi", "n": 9}, "n"),
    ("completions", {"prompt": "hi", "tools": [TOOL]}, "tools"),
    ("chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"messages": MESSAGES, "tools": [TOOL], "stream": True}, "stream"),
    ("chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0]"),
    ("chat/completions", {"messages": MESSAGES, "tools": [TOOL] * 2}, "tools"),
    (
        "chat/completions",
        {
            "messages": MESSAGES,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "x"}},
        },
        "tool_choice",
    ),
    (
        "chat/completions",
        {"messages": MESSAGES, "tools": [TOOL], "response_format": {"type": "json_object"}},
        "response_format",
    ),
    (
        "chat/completions",
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}],
                }
            ]
        },
        "messages[0].tool_calls[0]",
    ),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 2, "stream": True}, "n"),
    ("completions", {"prompt": "hi", "stop": ""}, "stop"),
    ("completions", {"prompt": "hi", "stop": ["ok", ""]}, "stop"),
    ("completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("completions", {"prompt": "hi", "speculative": {"strategy": "turbo"}}, "speculative"),
    ("completions", {"prompt": "hi", "speculative": {"bushiness": 3}}, "speculative"),
    (
        "completions",
        {"prompt": "hi", "speculative": {"strategy": "spork", "tau": 1}},
        "speculative",
    ),
    ("chat/completions", {"messages": [], "speculative": {}}, "messages"),
    (
        "completions",
        {"prompt": "hi", "speculative": {"strategy": "spork", "drafter": "recycle+model:/x"}},
        "speculative.drafter",
    ),
    (
        "completions",
        {"prompt": "hi", "speculative": {"strategy": "speculative", "k": 0}},
        "speculative",
    ),
    (
        "completions",
        {"prompt": "hi", "speculative": {"drafter": "model:/etc"}},
        "speculative.drafter",
    ),
    (
        "completions",
        {"prompt": "hi", "speculative": {"self_layers": "0-99999999"}},
        "speculative.self_layers",
    ),
    ("completions", {"prompt": "hi", "speculative": "fast"}, "speculative"),
    (
        "completions",
        {"prompt": "hi", "speculative": {"strategy": "spork", "recycle_prior": True}},
        "speculative.recycle_prior",
    ),
    (
        "completions",
        {"prompt": "hi", "speculative": {"strategy": "dspark", "forks": 2}},
        "speculative",
    ),
    ("completions", {"prompt": "hi", "speculative": {"strategy": "ar", "k": 2}}, "speculative"),
    ("completions", {"prompt": "hi", "max_token": 4}, "max_token"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("chat/completions", {"messages": MESSAGES, "logprobs": 3}, "logprobs"),
    ("chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    (
        "chat/completions",
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    ("completions", {"prompt": "hi", "stop": ["x" * 513]}, "stop"),
    ("completions", {"prompt": "hi", "speculative": HUGE_TREE}, "speculative"),
    ("completions", {"prompt": "hi", "speculative": ADAPTED_TREE}, "speculative"),
    ("completions", {"prompt": "hi", "speculative": LOSSY}, "speculative.lossy_typical"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "hi", "exact": 1}, "exact"),
    ("completions", {"prompt": [1, 99999999]}, "prompt"),
    (
        "chat/completions",
        {"messages": MESSAGES, "response_format": {"type": "yaml"}},
        "response_format",
    ),
    (
        "chat/completions",
        {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
        "response_format.json_schema",
    ),
    (
        "chat/completions",
        {
            "messages": MESSAGES,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integr"}},
            },
        },
        "response_format",
    ),
    (
        "completions",
        {"prompt": "hi", "response_format": {"type": "regex", "regex": "(("}},
        "response_format",
    ),
    (
        "completions",
        {"prompt": "hi", "response_format": {"type": "regex", "regex": r"[^\s\S]"}},
        "response_format",
    ),  # compiles, matches nothing: refused as the request opens
    (
        "chat/completions",
        {
            "messages": MESSAGES,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "#"}},
            },
        },
        "response_format",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_400(served: Served, path: str, body: bytes | dict, param: str | None) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    resp = httpx.post(f"{served.url}/v1/{path}", content=content, headers=headers, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


@pytest.mark.slow
@pytest.mark.parametrize(
    ("speculative", "strategy"),
    [({"drafter": "ngram"}, "speculative"), ({"min_k": 2}, "dspark"), ({"forks": 2}, "spork")],
)
def test_options_imply_their_strategy_as_on_the_command_line(
    served: Served, speculative: dict, strategy: str
) -> None:
    """A plain server takes `{"drafter": "ngram"}` as the CLI takes `--drafter ngram`: the
    options name the strategy they belong to (the output stays plain decoding's)."""
    base = {"prompt": "the cat sat on the mat, the cat", "max_tokens": 8, "temperature": 0}
    plain = httpx.post(f"{served.url}/v1/completions", json=base, timeout=60)
    resp = httpx.post(
        f"{served.url}/v1/completions", json={**base, "speculative": speculative}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert resp.json()["speculative"]["strategy"] == strategy


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["completions", "chat/completions"])
def test_penalties_and_logit_bias(served: Served, kind: str) -> None:
    """OpenAI's penalties and biases: the text of the library's plain decoding with the same
    settings, under the strategy the request asks for; a banned token never appears."""
    fields = {"max_tokens": 24, "temperature": 0, "presence_penalty": 0.5}
    fields["frequency_penalty"] = 1.0
    prompt = "List the numbers one, two, three, one, two, three, one, two, three."
    tok = served.reference.tokenizer
    banned = tok.encode(" one")[-1]
    body = {**fields, "logit_bias": {str(banned): -100}}
    body |= {"prompt": prompt} if kind == "completions" else {}
    body |= {"messages": [{"role": "user", "content": prompt}]} if kind != "completions" else {}
    sampling = SamplingParams(
        presence_penalty=0.5, frequency_penalty=1.0, logit_bias=((banned, -100.0),)
    )
    config = GenerationConfig(max_new_tokens=24)
    chat = kind != "completions"
    source = body["messages"] if chat else prompt
    expected = served.reference.generate(source, chat=chat, config=config, sampling=sampling)
    assert banned not in expected.token_ids
    for speculative in (None, {"strategy": "spork", "drafter": "recycle+ngram"}):
        sent = body if speculative is None else {**body, "speculative": speculative}
        resp = httpx.post(f"{served.url}/v1/{kind}", json=sent, timeout=60)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        text = choice["text"] if kind == "completions" else choice["message"]["content"]
        assert text == expected.text


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["completions", "chat/completions"])
def test_n_choices(served: Served, kind: str) -> None:
    """n completions of one prompt, decoded together: choice i is what the library samples
    with seed + i; greedy choices are all the same; usage counts every choice's tokens."""
    chat = kind != "completions"
    prompt = "Write a one-line poem about the sea." if chat else "Once upon a time, the sea"
    source: Any = [{"role": "user", "content": prompt}] if chat else prompt
    body = {"max_tokens": 16, "temperature": 0.9, "seed": 5, "n": 3}
    body |= {"messages": source} if chat else {"prompt": prompt}
    body["speculative"] = {"strategy": "speculative", "drafter": "ngram"}
    resp = httpx.post(f"{served.url}/v1/{kind}", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    texts = [c["text"] if not chat else c["message"]["content"] for c in choices]
    config = GenerationConfig(max_new_tokens=16)
    tokens = 0
    for i, text in enumerate(texts):
        sampling = SamplingParams(temperature=0.9, seed=5 + i)
        expected = served.reference.generate(source, chat=chat, config=config, sampling=sampling)
        assert text == expected.text
        tokens += len(expected.token_ids)
        assert choices[i]["speculative"]["strategy"] == "speculative"
    assert len(set(texts)) > 1  # distinct seeds: distinct completions
    assert out["usage"]["completion_tokens"] == tokens
    greedy = {**body, "temperature": 0, "n": 2}
    choices = httpx.post(f"{served.url}/v1/{kind}", json=greedy, timeout=120).json()["choices"]
    same = ("text", "message", "finish_reason")
    assert [{k: c.get(k) for k in same} for c in choices] == [
        {k: choices[0].get(k) for k in same}
    ] * 2


def _tool_call(served: Served, body: dict, speculative: dict | None = None) -> dict:
    sent = {"max_tokens": 48, "temperature": 0, **body}
    if speculative is not None:
        sent["speculative"] = speculative
    resp = httpx.post(f"{served.url}/v1/chat/completions", json=sent, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


@pytest.mark.slow
def test_a_required_tool_call_is_a_valid_call_under_every_strategy(served: Served) -> None:
    """tool_choice "required": the output is constrained to one call's JSON, so its arguments
    follow the tool's schema; speculation gives plain decoding's call."""
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    body = {"messages": ask, "tools": [TOOL, TIME_TOOL], "tool_choice": "required"}
    calls = []
    spork = {"strategy": "spork", "drafter": "recycle+ngram"}
    suffix = {"strategy": "speculative", "drafter": "suffix"}  # drafts what the grammar forces
    unforced = {"strategy": "speculative", "drafter": "ngram", "grammar_drafts": False}
    for speculative in (None, spork, suffix, unforced):
        choice = _tool_call(served, body, speculative)
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in ("get_weather", "get_time")
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert isinstance(arguments["city"], str)
        calls.append(call["function"])
    assert calls[1:] == calls[:1] * 3
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = _tool_call(served, {**body, "tool_choice": named})
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_time"


@pytest.mark.slow
def test_tools_in_a_conversation(served: Served) -> None:
    """A call, its result and the follow-up: accepted in messages, answered (with text or a
    call, as the model decides: tool_choice auto)."""
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        {"role": "user", "content": "What is the weather like in Paris today?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "celsius": 21}'},
    ]
    choice = _tool_call(served, {"messages": messages, "tools": [TOOL]})
    message = choice["message"]
    assert message["role"] == "assistant"
    if choice["finish_reason"] == "tool_calls":
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    else:
        assert isinstance(message["content"], str) and "tool_calls" not in message
    none = _tool_call(served, {"messages": messages, "tools": [TOOL], "tool_choice": "none"})
    assert "tool_calls" not in none["message"]


@pytest.mark.slow
def test_null_inside_speculative_means_not_given(served: Served) -> None:
    base = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
    plain = httpx.post(f"{served.url}/v1/completions", json=base, timeout=60)
    body = {**base, "speculative": {"strategy": None, "drafter": None}}
    resp = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"prompt": "hi", "temperature": "0.5"}, "got '0.5'"),  # a string, not the number
        ({"prompt": "hi", "top_p": "0.5"}, "got '0.5'"),
        ({"prompt": "hi", "seed": "5"}, "got '5'"),
        ({"prompt": [1, "a"]}, 'prompt[1] is "a"'),
        ({"prompt": [-1, 5]}, "prompt[0] is -1"),
        ({"prompt": [1.5]}, "prompt[0] is 1.5"),
        ({"prompt": [[1], [2]]}, "one prompt per request"),
        ({"prompt": [[1, -2]]}, "prompt[0][1] is -2"),  # a batch of one prompt
        ({"prompt": [1, "y" * 1000]}, 'prompt[1] is "yyyy'),
    ],
)
def test_a_refusal_names_the_bad_value_as_sent(served: Served, body: dict, words: str) -> None:
    resp = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert words in resp.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("field", ["max_tokens", "model", "temperature", "seed"])
def test_a_huge_bad_value_is_not_echoed_whole(served: Served, field: str) -> None:
    body = {"prompt": "hi", field: "x" * 2_000_000}
    resp = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert len(resp.content) < 2_000 and field in error["message"]
    assert "characters elided" in error["message"]


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ar", "spork"])
def test_response_format_json_schema_matches_library(served: Served, strategy: str) -> None:
    from specfork.constraint import Constraint

    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    resp = served.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=64,
        temperature=0,
        response_format=fmt,
        extra_body={} if strategy == "ar" else {"speculative": STRATEGIES[strategy]},
    )
    text = resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert set(json.loads(text)) == {"name", "age"}
    config = GenerationConfig(max_new_tokens=64, constraint=Constraint.json_schema(PERSON))
    ref = served.reference.generate(messages, config=config, spec=_spec(strategy))
    assert text == ref.text
    any_object = served.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
    )
    # SmolLM2 writes a long object: 64 tokens may end it before it closes (finish "length"),
    # a valid prefix of the library's constrained output
    choice = any_object.choices[0]
    config = GenerationConfig(max_new_tokens=64, constraint=Constraint.json_object())
    assert choice.message.content == served.reference.generate(messages, config=config).text
    assert choice.message.content.lstrip().startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.slow
def test_self_layers_out_of_range_is_400_and_server_serves_on(served: Served) -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 2,
        "speculative": {"strategy": "speculative", "drafter": "self", "self_layers": "0-99"},
    }
    resp = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400 and "out of range" in resp.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        served.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=9)
    assert exc.value.status_code == 400
    ok = served.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert (
        _metric(served.url, "specfork_requests_total", '{endpoint="completions",status="400"}') >= 2
    )


@pytest.mark.slow
def test_refusals_before_routing_are_counted(served: Served) -> None:
    """A body that is not JSON is refused by the guard (415) and still counted."""
    labels = '{endpoint="completions",status="415"}'
    before = _metric(served.url, "specfork_requests_total", labels)
    resp = httpx.post(f"{served.url}/v1/completions", content=b"prompt=hi", timeout=60)
    assert resp.status_code == 415
    assert _metric(served.url, "specfork_requests_total", labels) == before + 1
    httpx.post(f"{served.url}/v1/anything", content=b"x", timeout=60)
    assert _metric(served.url, "specfork_requests_total", '{endpoint="other",status="415"}') >= 1


@pytest.mark.slow
def test_unknown_routes_use_the_error_shape(served: Served) -> None:
    for resp, status in (
        (httpx.get(f"{served.url}/v1/nothing"), 404),
        (httpx.get(f"{served.url}/v1/completions"), 405),
        (httpx.get(f"{served.url}/v1/models/gpt-4"), 404),
    ):
        assert resp.status_code == status
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


# -- load, disconnects -----------------------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


@pytest.mark.slow
def test_32_concurrent_clients(served: Served) -> None:
    n_clients, max_tokens = 32, 8
    gc.collect()
    rss_before = _rss_mb()
    done = threading.Event()
    health: list[int] = []

    def watch_health() -> None:
        while not done.is_set():
            health.append(httpx.get(f"{served.url}/health", timeout=30).status_code)
            done.wait(0.2)

    def one(i: int) -> tuple[str | None, int]:
        strategy = "ngram" if i % 2 else "ar"
        kwargs = dict(
            model=MODEL,
            prompt=f"Count from {i}: {i}, {i + 1},",
            temperature=0,
            max_tokens=max_tokens,
            extra_body=_extra(strategy),
        )
        if i % 4 == 3:  # a quarter streams
            chunks = list(
                served.client.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kwargs
                )
            )
            return chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens
        resp = served.client.completions.create(**kwargs)
        return resp.choices[0].finish_reason, resp.usage.completion_tokens

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    try:
        with ThreadPoolExecutor(n_clients) as pool:
            results = list(pool.map(one, range(n_clients)))
    finally:
        done.set()
        watcher.join()
    assert results == [("length", max_tokens)] * n_clients
    assert health and set(health) == {200}
    gc.collect()
    assert _rss_mb() - rss_before < 150, (rss_before, _rss_mb())
    assert _metric(served.url, "specfork_queue_depth") == 0


@pytest.mark.slow
def test_disconnect_mid_stream_stops_generation(served: Served) -> None:
    cancelled = _metric(served.url, "specfork_generations_cancelled_total")
    gone = _metric(served.url, "specfork_requests_total", '{endpoint="completions",status="499"}')
    body = {
        "prompt": PROMPT,
        "max_tokens": 900,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        first = next(line for line in resp.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"]
    # 900 tokens would take minutes here; the count moves only if the worker stopped early
    _until(
        lambda: _metric(served.url, "specfork_generations_cancelled_total") == cancelled + 1,
        "the generation to be cancelled",
    )
    _until(
        lambda: (
            _metric(served.url, "specfork_requests_total", '{endpoint="completions",status="499"}')
            == gone + 1
        ),
        "the request to be counted as 499",
    )
    resp = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 4


# -- scheduling, on a fake engine ------------------------------------------------------------------


class FakeStream:
    """Yields one delta per requested token after the engine lets it go; sets `result`."""

    def __init__(self, engine: FakeEngine, ids: list[int], n: int) -> None:
        self.engine, self.ids, self.n = engine, ids, n
        self.result: GenerationResult | None = None

    logprobs = None

    def rounds(self) -> Iterator[str]:
        if not self.engine.permits.acquire(timeout=60):
            raise TimeoutError("the test never released this request")
        if self.engine.fail:
            raise RuntimeError("boom")
        for _ in range(self.n):
            yield "x"
        stats = GenerationStats(
            prompt_tokens=len(self.ids), new_tokens=self.n, target_forwards=self.n - 1
        )
        self.result = GenerationResult("x" * self.n, [7] * self.n, "length", self.ids, stats)


class FakeEngine:
    """Duck-types `Generator`; each request waits for a permit, starts are reported."""

    context = 64

    def __init__(self, spec: SpecConfig, *, gated: bool = True, fail: bool = False) -> None:
        self.default_spec = spec
        self.fail = fail
        self.built_in = threading.get_ident()
        self.ran_in: set[int] = set()
        self.permits = threading.Semaphore(0 if gated else 1_000_000)
        self.started: queue.Queue[SpecConfig] = queue.Queue()

    def encode_prompt(self, prompt: object, chat: bool | None = None) -> list[int]:
        return [1, 2, 3]

    def stream(
        self,
        prompt: list[int],
        *,
        config: GenerationConfig,
        sampling: SamplingParams,
        spec: SpecConfig | None,
    ) -> FakeStream:
        self.started.put(spec or self.default_spec)
        self.ran_in.add(threading.get_ident())
        return FakeStream(self, prompt, config.max_new_tokens)


NGRAM = SpecConfig("speculative", "ngram", k=4)


def _post(url: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json=body or {"prompt": "hi", "max_tokens": 3}, timeout=60
    )


def test_queue_full_is_429_with_retry_after() -> None:
    engine = FakeEngine(NGRAM)
    app = create_app(engine, model_name="fake", queue_size=1, retry_after=3)
    with serve_in_background(app) as url, ThreadPoolExecutor(2) as pool:
        running = pool.submit(_post, url)
        engine.started.get(timeout=30)  # the first request is running
        waiting = pool.submit(_post, url)
        _until(lambda: app.state.worker.depth == 1, "the second request to queue")
        full = _post(url)
        assert full.status_code == 429 and full.headers["Retry-After"] == "3"
        error = full.json()["error"]
        assert error["code"] == "queue_full" and set(error) == {"message", "type", "param", "code"}
        engine.permits.release(2)
        assert running.result().status_code == 200 and waiting.result().status_code == 200
        assert _metric(url, "specfork_requests_total", '{endpoint="completions",status="429"}') == 1


def test_plain_decoding_while_the_queue_is_deep() -> None:
    engine = FakeEngine(NGRAM)
    app = create_app(engine, model_name="fake", queue_size=8, plain_above_queue=0)
    with serve_in_background(app) as url, ThreadPoolExecutor(3) as pool:
        first = pool.submit(_post, url)
        assert engine.started.get(timeout=30) == NGRAM
        assert _metric(url, "specfork_speculation_enabled") == 1
        later = []
        for depth in (1, 2):  # one at a time, so that their order in the queue is known
            later.append(pool.submit(_post, url))
            _until(lambda d=depth: app.state.worker.depth == d, f"{depth} requests to queue")
        engine.permits.release()
        assert engine.started.get(timeout=30) == SpecConfig()  # one still waits: plain
        assert _metric(url, "specfork_speculation_enabled") == 0
        engine.permits.release()
        assert engine.started.get(timeout=30) == NGRAM  # the queue is empty again
        assert _metric(url, "specfork_speculation_enabled") == 1
        engine.permits.release()
        stats = [f.result().json()["speculative"] for f in (first, *later)]
    assert [s["strategy"] for s in stats] == ["speculative", "ar", "speculative"]
    assert [s["plain_under_load"] for s in stats] == [False, True, False]


def test_internal_error_is_500_and_the_server_serves_on() -> None:
    engine = FakeEngine(SpecConfig(), gated=False, fail=True)
    app = create_app(engine, model_name="fake")
    with serve_in_background(app) as url:
        resp = _post(url)
        assert resp.status_code == 500
        assert resp.json()["error"]["type"] == "server_error"
        streamed = _post(url, {"prompt": "hi", "max_tokens": 3, "stream": True})
        assert streamed.status_code == 200 and '"error"' in streamed.text
        assert streamed.text.rstrip().endswith("data: [DONE]")
        engine.fail = False
        assert _post(url).json()["choices"][0]["text"] == "xxx"
        assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_requests_run_on_the_thread_that_loaded_the_model() -> None:
    """PyTorch's CPU thread pool runs at full speed only for the thread that created it
    (specfork.engine.thread); `specfork serve` loads the model on the thread that serves."""
    thread = model_thread()
    engine = run_in(thread, FakeEngine, SpecConfig(), gated=False)
    assert engine.built_in != threading.get_ident()
    app = create_app(engine, model_name="fake", thread=thread)
    with serve_in_background(app) as url:
        for _ in range(3):
            assert _post(url).status_code == 200
    assert engine.ran_in == {engine.built_in}


def test_without_a_thread_the_worker_keeps_one_thread() -> None:
    engine = FakeEngine(SpecConfig(), gated=False)
    app = create_app(engine, model_name="fake")
    with serve_in_background(app) as url:
        for _ in range(3):
            assert _post(url).status_code == 200
    assert len(engine.ran_in) == 1 and engine.built_in not in engine.ran_in


def test_body_too_large_is_413() -> None:
    app = create_app(FakeEngine(SpecConfig(), gated=False), model_name="fake", max_body_bytes=64)
    with serve_in_background(app) as url:
        resp = _post(url, {"prompt": "x" * 100})
        assert resp.status_code == 413 and resp.json()["error"]["message"]


# -- the serve command -----------------------------------------------------------------------------


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verbose", action="store_true")
    serve_command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_flags() -> None:
    args = _serve_args("--strategy", "speculative", "--k", "3", "--plain-above-queue", "4")
    assert (args.host, args.port, args.queue_size, args.plain_above_queue) == (
        "127.0.0.1",
        8000,
        64,
        4,
    )
    assert (args.strategy, args.k) == ("speculative", 3)


def test_serve_reports_bad_flags_and_taken_port_before_loading() -> None:
    console = Console(stderr=True)
    with pytest.raises(SpecforkError, match="k \\(draft length\\)"):
        serve_command.run(
            _serve_args("-m", "no-such-model", "--strategy", "speculative", "--k", "0"), console
        )
    with pytest.raises(SpecforkError, match="--default-max-tokens must be at least 1, got 0"):
        serve_command.run(_serve_args("-m", "no-such-model", "--default-max-tokens", "0"), console)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SpecforkError, match="cannot listen"):
            serve_command.run(_serve_args("-m", "no-such-model", "--port", str(port)), console)


@pytest.mark.parametrize("flags", [[], ["--fixed-strategy"], ["--strategy", "speculative"]])
def test_serve_from_the_command_line_reaches_its_own_checks(capsys, flags: list[str]) -> None:
    """Through `specfork` itself (main parses and resolves the strategy flags), not only
    `serve.run`: a serve flag may not collide with what other commands set."""
    code, out, err = run_cli(capsys, ["serve", "-m", "no-such-model", *flags])
    assert code == 2 and out == "" and "unknown model 'no-such-model'" in err, err


@pytest.mark.slow
def test_exact_requests(served: Served) -> None:
    """`exact: true` is honoured on batch-invariant steps (the kernels) and refused, with a 400
    naming the path, where the steps are not (the eager PyTorch path)."""
    from specfork.loading.loader import load_model

    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "exact": True}
    if served.reference.model.batch_invariant:
        resp = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
    eager = load_model(MODEL, dtype="float32", kernels=False, progress=False)
    app = create_app(Generator(eager, max_context=CONTEXT), model_name=MODEL)
    with serve_in_background(app) as url:
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 400
        assert "batch-invariant" in resp.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json={**body, "exact": False}).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("grace", [1, 5])
def test_shutdown_answers_every_request(smollm_f32: LoadedModel, grace: int) -> None:
    """On shutdown a waiting request gets a 503 in OpenAI's shape (at once); a running stream
    ends with an error event and [DONE] a second before the grace period ends — never cut
    off by uvicorn's cancellation, never a plain-text 500."""
    import uvicorn

    from specfork.server.run import bind_socket
    from specfork.server.shutdown import DrainingServer

    app = create_app(Generator(smollm_f32, max_context=CONTEXT), model_name=MODEL, max_running=1)
    worker = app.state.worker
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace)
    server, sock = DrainingServer(config, worker), bind_socket("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    _until(lambda: server.started, "the server to start")
    url = "http://{}:{}/v1/completions".format(*sock.getsockname()[:2])
    body = {"prompt": PROMPT, "max_tokens": CONTEXT - 64, "temperature": 0, "ignore_eos": True}
    answers: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as resp:
            answers["stream"] = (resp.status_code, [line for line in resp.iter_lines() if line])

    def waiting() -> None:
        resp = httpx.post(url, json=body, timeout=60)
        answers["waiting"] = (resp.status_code, resp.json())

    clients = [threading.Thread(target=stream)]
    clients[0].start()
    _until(lambda: len(worker._jobs) == 1, "the stream to run")
    clients.append(threading.Thread(target=waiting))
    clients[1].start()
    _until(lambda: worker.depth == 1, "the second request to wait")
    server.should_exit = True
    for client in clients:
        client.join(60)
    thread.join(30)
    sock.close()
    status, error = answers["waiting"]
    assert status == 503 and error["error"]["message"] == "the server is shutting down"
    status, lines = answers["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    assert "the server is shutting down" in lines[-2]
    assert not thread.is_alive()
