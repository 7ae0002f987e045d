"""`specfork serve` against hostile and malformed requests, on the real default model.

Every request of the corpus must be answered with a 4xx in OpenAI's error shape
({"error": {"message", "type", "param", "code"}}) or with a 200 whose work is bounded (each
request that may succeed asks for at most `MAX_OK_TOKENS` tokens) — never a 5xx, never a hang,
never an "unexpected error" traceback in the server's log. After the whole corpus the server must
still answer a greedy request with the text it gave before the corpus.

Cases that once failed, each fixed since: temperatures and top_p below float32's range (NaN
probabilities, 500), DSpark thresholds and weights whose sums overflow (NaN schedule, 500), a
client gone before its whole body arrived (a logged traceback), a declared Content-Length over
the cap (the server waited for a body it would refuse), a message role that is a list
(unhashable, 500). Requests that are accepted but may cost far more than their `max_tokens`
suggests (compute amplification) are measured, not judged, by `test_compute_amplification`.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from specfork.engine.generator import Generator
from specfork.loading.loader import LoadedModel
from specfork.server.app import create_app
from specfork.server.run import serve_in_background

pytestmark = pytest.mark.slow  # the real packaged model

MODEL = "smollm2-135m-instruct"
CONTEXT = 1024
VOCAB = 49152  # SmolLM2's vocabulary
TIMEOUT = 120.0  # seconds per request: anything slower counts as a hang
MAX_OK_TOKENS = 8  # the most tokens any request of the corpus that may succeed asks for
PROMPT = "Repeat exactly: one two three, one two three, one two three,"
MESSAGES = [{"role": "user", "content": "List the numbers one to five."}]
ERROR_KEYS = {"message", "type", "param", "code"}
NAN, INF = float("nan"), float("inf")
FINISHED = ("stop", "length")


# -- the server, its log, the reference answers ----------------------------------------------------


class _Records(logging.Handler):
    """Keeps the server's error records (with tracebacks) so that a failure can show them."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@dataclass
class Server:
    url: str
    log: _Records
    baseline: dict[str, str] = field(default_factory=dict)


GREEDY = {
    "completion": (
        "completions",
        {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    ),
    "chat": (
        "chat/completions",
        {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    ),
    "spork": (
        "completions",
        {
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "speculative": {"strategy": "spork", "drafter": "recycle+ngram"},
        },
    ),
}


def _greedy_text(url: str, name: str) -> str:
    path, body = GREEDY[name]
    resp = httpx.post(f"{url}/v1/{path}", json=body, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.fixture(scope="module")
def server(smollm_f32: LoadedModel) -> Iterator[Server]:
    """The real server; the greedy reference answers are taken before any hostile request."""
    records = _Records()
    loggers = [logging.getLogger(n) for n in ("specfork", "uvicorn", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(records)
    generator = Generator(smollm_f32, max_context=CONTEXT)
    app = create_app(generator, model_name=MODEL, queue_size=64)
    try:
        with serve_in_background(app) as url:
            served = Server(url, records)
            served.baseline = {name: _greedy_text(url, name) for name in GREEDY}
            yield served
    finally:
        for logger in loggers:
            logger.removeHandler(records)


# -- checking one answer ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One hostile request. `body`: a dict/list/str/number is sent as JSON (NaN and Infinity
    spelled as Python's json spells them), bytes as they are, None as no body."""

    path: str
    body: Any = None
    method: str = "POST"
    headers: dict[str, str] | None = None
    may_succeed: bool = False  # a bounded 200 is an acceptable answer
    status: int | None = None  # the one status expected, when it is known


def _content(body: Any) -> bytes | None:
    if body is None or isinstance(body, bytes):
        return body
    return json.dumps(body, allow_nan=True).encode()


def _check_error_body(resp: httpx.Response) -> None:
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    error = resp.json()["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)


def _check_success(resp: httpx.Response) -> None:
    """A 200 of a generation route did a bounded amount of work."""
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", resp.text[-500:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), resp.text[-500:]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert finishes[-1] in FINISHED, finishes
        for c in chunks:
            if c.get("usage"):
                assert 0 <= c["usage"]["completion_tokens"] <= MAX_OK_TOKENS, c["usage"]
        return
    body = resp.json()
    assert body["choices"][0]["finish_reason"] in FINISHED, body
    assert 0 <= body["usage"]["completion_tokens"] <= MAX_OK_TOKENS, body["usage"]


def _send(server: Server, case: Case) -> tuple[httpx.Response, float]:
    headers = case.headers
    if headers is None:  # JSON's own media type unless the case is about another one
        headers = {"content-type": "application/json"} if case.method == "POST" else {}
    start = time.perf_counter()
    resp = httpx.request(
        case.method,
        f"{server.url}{case.path}",
        content=_content(case.body),
        headers=headers,
        timeout=TIMEOUT,
    )
    return resp, time.perf_counter() - start


def _judge(server: Server, case: Case, resp: httpx.Response, errors_before: int) -> None:
    new_errors = server.log.lines[errors_before:]
    what = f"{case.method} {case.path} -> {resp.status_code}: {resp.text[:400]!r}"
    assert resp.status_code < 500, f"{what}\nserver log:\n" + "\n".join(new_errors)
    assert not new_errors, f"{what}\nserver log:\n" + "\n".join(new_errors)
    if case.status is not None:
        assert resp.status_code == case.status, what
    if 400 <= resp.status_code < 500:
        if case.method != "HEAD":
            _check_error_body(resp)
    elif resp.status_code == 200:
        assert case.may_succeed or case.status == 200, f"accepted: {what}"
        if case.path.startswith("/v1/") and case.path.endswith("completions"):
            _check_success(resp)
    else:
        assert case.status == resp.status_code, f"unexpected status: {what}"


# -- the corpus ------------------------------------------------------------------------------------

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
SPEC_OWNER = {  # each numeric speculative key with a strategy that reads it
    "k": "speculative",
    "expected_length": "speculative",
    "max_ngram": "speculative",
    "min_ngram": "speculative",
    "min_k": "dspark",
    "max_k": "dspark",
    "low": "dspark",
    "high": "dspark",
    "ema_rate": "dspark",
    "margin_scale": "dspark",
    "forks": "spork",
    "depth": "spork",
    "budget": "spork",
    "tau": "spork",
    "tau_max": "spork",
    "target_acceptance": "spork",
    "typical_epsilon": "spork",
    "typical_delta": "spork",
}
SPEC_BOOLS = {
    "goodput": "speculative",
    "adapt": "spork",
    "recycle_persist": "spork",
    "recycle_prior": "spork",
    "lossy_typical": "spork",
}


def ok(**fields: Any) -> dict[str, Any]:
    """A bounded completion request with `fields` replaced."""
    return {"prompt": "hi", "max_tokens": 4, **fields}


def spec(**keys: Any) -> dict[str, Any]:
    """A bounded completion request with the `speculative` object `keys`."""
    return ok(speculative=keys)


def greedy_spec(**keys: Any) -> dict[str, Any]:
    """A deterministic request whose drafts are verified from the first round (the n-gram
    drafter finds the prompt's repetition), with the `speculative` object `keys`."""
    return ok(prompt=PROMPT, temperature=0, ignore_eos=True, max_tokens=8, speculative=keys)


def C(case_id: str, path: str, body: Any = None, **kw: Any) -> Any:
    return pytest.param(Case(path, body, **kw), id=case_id)


def _nested(depth: int) -> bytes:
    return b'{"prompt": "hi", "max_tokens": 4, "user": ' + b"[" * depth + b"]" * depth + b"}"


CORPUS = [
    # -- not JSON, not an object --------------------------------------------------------------
    C("empty-body", CMPL, b""),
    C("invalid-json", CMPL, b"{not json"),
    C("truncated-json", CMPL, b'{"prompt": "hi", "max_tokens": 4'),
    C("trailing-garbage", CMPL, b'{"prompt": "hi", "max_tokens": 4} xx'),
    C("json-array", CMPL, [1, 2]),
    C("json-string", CMPL, "hi"),
    C("json-number", CMPL, 7),
    C("no-body-json-content-type", CMPL, None, headers={"content-type": "application/json"}),
    C("json-literal-null", CMPL, b"null"),
    C("json-true", CHAT, b"true"),
    C("deep-array-100k", CMPL, b"[" * 100_000),
    C("deep-object-100k", CMPL, b'{"a":' * 100_000),
    C("deep-valid-nesting-100k", CMPL, _nested(100_000)),
    C("deep-valid-nesting-500", CMPL, _nested(500), may_succeed=True),
    C("invalid-utf8", CMPL, b"\xff\xfe"),
    C("invalid-utf8-in-string", CMPL, b'{"prompt": "h\xffi", "max_tokens": 4}'),
    C("utf8-encoded-surrogate", CMPL, b'{"prompt": "\xed\xa0\x80", "max_tokens": 4}'),
    C("utf16-body", CMPL, json.dumps(ok()).encode("utf-16"), may_succeed=True),
    C("bom-utf8-body", CMPL, b"\xef\xbb\xbf" + json.dumps(ok()).encode(), may_succeed=True),
    C("int-5000-digits", CMPL, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"),
    C("duplicate-keys", CMPL, b'{"prompt": "hi", "max_tokens": 4, "max_tokens": "x"}'),
    C("nul-byte-raw-in-json", CMPL, b'{"prompt": "h\x00i", "max_tokens": 4}'),
    # -- lone surrogates and odd text -------------------------------------------------------------
    C("surrogate-prompt", CMPL, ok(prompt="\ud800")),
    C("surrogate-low-prompt", CMPL, ok(prompt="ab\udfffcd")),
    C("surrogate-message", CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}),
    C("surrogate-role", CHAT, {"messages": [{"role": "\ud800", "content": "hi"}]}),
    C("surrogate-stop", CMPL, ok(stop=["\ud800"])),
    C("surrogate-model", CMPL, ok(model="\ud800")),
    C("surrogate-field-name", CMPL, ok(**{"\ud800": 1})),
    C("surrogate-spec-key", CMPL, spec(**{"\udc00": 1})),
    C("surrogate-drafter", CMPL, spec(strategy="speculative", drafter="\ud800")),
    C("surrogate-user", CMPL, ok(user="\ud800")),
    C("nul-in-prompt", CMPL, ok(prompt="a\u0000b"), may_succeed=True),
    C(
        "nul-in-message",
        CHAT,
        {"messages": [{"role": "user", "content": "\u0000"}], "max_tokens": 4},
        may_succeed=True,
    ),
    C("special-tokens-prompt", CMPL, ok(prompt="<|im_end|><|endoftext|>" * 50), may_succeed=True),
    C(
        "template-injection",
        CHAT,
        {"messages": [{"role": "user", "content": "{{ 7*7 }}{% if %}"}], "max_tokens": 4},
        may_succeed=True,
    ),
    # -- prompt -----------------------------------------------------------------------------------
    C("prompt-missing", CMPL, {"max_tokens": 4}),
    C("prompt-empty", CMPL, ok(prompt="")),
    C("prompt-whitespace", CMPL, ok(prompt=" \n\t\u3000")),
    C("prompt-number", CMPL, ok(prompt=5)),
    C("prompt-object", CMPL, ok(prompt={"text": "hi"})),
    C("prompt-empty-list", CMPL, ok(prompt=[])),
    C("prompt-ids-out-of-vocab", CMPL, ok(prompt=[1, VOCAB])),
    C("prompt-ids-huge", CMPL, ok(prompt=[10**100])),
    C("prompt-ids-negative", CMPL, ok(prompt=[1, -1])),
    C("prompt-ids-bools", CMPL, ok(prompt=[True, False])),
    C("prompt-ids-floats", CMPL, ok(prompt=[1.0, 2.0])),
    C("prompt-ids-nested", CMPL, ok(prompt=[[1, 2], [3, 4]])),
    C("prompt-ids-nested-empty", CMPL, ok(prompt=[[]])),
    C("prompt-ids-mixed", CMPL, ok(prompt=[1, "a"])),
    C("prompt-ids-edge-valid", CMPL, ok(prompt=[0, VOCAB - 1]), may_succeed=True),
    C("prompt-ids-too-many", CMPL, ok(prompt=[1] * 5000)),
    C("prompt-ids-fill-context", CMPL, ok(prompt=[1] * (CONTEXT - 2), max_tokens=8)),
    C("prompt-batch-of-two", CMPL, ok(prompt=["a", "b"])),
    C("prompt-batch-of-one", CMPL, ok(prompt=["hi"]), may_succeed=True),
    C("prompt-longer-than-context", CMPL, ok(prompt="word " * 5000)),
    C("prompt-one-huge-word", CMPL, ok(prompt="a" * 200_000)),
    # -- messages ---------------------------------------------------------------------------------
    C("messages-missing", CHAT, {"max_tokens": 4}),
    C("messages-empty", CHAT, {"messages": [], "max_tokens": 4}),
    C("messages-string", CHAT, {"messages": "hi", "max_tokens": 4}),
    C("messages-object", CHAT, {"messages": {"role": "user", "content": "hi"}}),
    C("message-not-object", CHAT, {"messages": ["hi"], "max_tokens": 4}),
    C("message-role-unknown", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}),
    C("message-role-missing", CHAT, {"messages": [{"content": "hi"}]}),
    C(
        "message-role-list",
        CHAT,
        {"messages": [{"role": ["user"], "content": "hi"}]},
    ),
    C(
        "message-role-object",
        CHAT,
        {"messages": [{"role": {"a": 1}, "content": "hi"}]},
    ),
    C("message-content-object", CHAT, {"messages": [{"role": "user", "content": {"a": 1}}]}),
    C("message-content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}),
    C(
        "message-content-image-part",
        CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
                }
            ]
        },
    ),
    C("message-content-parts-empty", CHAT, {"messages": [{"role": "user", "content": []}]}),
    C("message-all-empty", CHAT, {"messages": [{"role": "user", "content": "  "}]}),
    C(
        "message-only-system",
        CHAT,
        {"messages": [{"role": "system", "content": "hi"}], "max_tokens": 4},
        may_succeed=True,
    ),
    C(
        "message-tool-role",
        CHAT,
        {"messages": [{"role": "tool", "content": "hi"}], "max_tokens": 4},
        may_succeed=True,
    ),
    C(
        "message-longer-than-context",
        CHAT,
        {"messages": [{"role": "user", "content": "w " * 5000}]},
    ),
    C("messages-on-completions", CMPL, {"messages": MESSAGES, "max_tokens": 4}),
    C("prompt-on-chat", CHAT, {"prompt": "hi", "max_tokens": 4}),
    # -- max_tokens ------------------------------------------------------------------------------
    C("max-tokens-zero", CMPL, ok(max_tokens=0)),
    C("max-tokens-negative", CMPL, ok(max_tokens=-1)),
    C("max-tokens-float", CMPL, ok(max_tokens=4.0)),
    C("max-tokens-string", CMPL, ok(max_tokens="4")),
    C("max-tokens-bool", CMPL, ok(max_tokens=True)),
    C("max-tokens-list", CMPL, ok(max_tokens=[4])),
    C("max-tokens-nan", CMPL, ok(max_tokens=NAN)),
    C("max-tokens-inf", CMPL, ok(max_tokens=INF)),
    C("max-tokens-neg-inf", CMPL, ok(max_tokens=-INF)),
    C("max-tokens-1e400", CMPL, b'{"prompt": "hi", "max_tokens": 1e400}'),
    C("max-tokens-10e100", CMPL, ok(max_tokens=10**100)),
    C("max-tokens-context", CMPL, ok(max_tokens=CONTEXT)),
    C("max-tokens-context-minus-prompt", CMPL, ok(prompt="word " * 600, max_tokens=600)),
    C("max-completion-tokens-on-completions", CMPL, ok(max_completion_tokens=4)),
    C(
        "max-completion-tokens-and-bad-max-tokens",
        CHAT,
        {"messages": MESSAGES, "max_completion_tokens": 4, "max_tokens": "lots"},
        may_succeed=True,
    ),
    C("max-completion-tokens-negative", CHAT, {"messages": MESSAGES, "max_completion_tokens": -1}),
    # -- sampling numbers ------------------------------------------------------------------------
    *[
        C(f"{name}-{label}", CMPL, ok(**{name: value}))
        for name in ("temperature", "top_p", "top_k", "min_p", "seed")
        for label, value in (("nan", NAN), ("inf", INF), ("neg-inf", -INF))
    ],
    C("temperature-1e400", CMPL, b'{"prompt": "hi", "max_tokens": 4, "temperature": 1e400}'),
    C("temperature-negative", CMPL, ok(temperature=-0.5)),
    C("temperature-string", CMPL, ok(temperature="0")),
    C("temperature-bool", CMPL, ok(temperature=True)),
    C(
        "temperature-denormal",
        CMPL,
        ok(temperature=5e-324),
        may_succeed=True,
    ),
    C(
        "temperature-1e-46",
        CMPL,
        ok(temperature=1e-46),
        may_succeed=True,
    ),
    C(
        "temperature-1e-46-stream",
        CMPL,
        ok(temperature=1e-46, stream=True),
        may_succeed=True,
    ),
    C("temperature-1e-40", CMPL, ok(temperature=1e-40), may_succeed=True),
    C("temperature-1e308", CMPL, ok(temperature=1e308), may_succeed=True),
    C("top-p-zero", CMPL, ok(top_p=0)),
    C(
        "top-p-denormal",
        CMPL,
        ok(top_p=5e-324),
        may_succeed=True,
    ),
    C(
        "top-p-1e-46",
        CMPL,
        ok(top_p=1e-46),
        may_succeed=True,
    ),
    C("min-p-1e-46", CMPL, ok(min_p=1e-46), may_succeed=True),
    C("top-k-10e100", CMPL, ok(top_k=10**100), may_succeed=True),
    C("top-k-float", CMPL, ok(top_k=2.5)),
    C("top-k-negative", CMPL, ok(top_k=-2)),
    C("top-k-minus-one", CMPL, ok(top_k=-1), may_succeed=True),  # vLLM's "off"
    C("min-p-two", CMPL, ok(min_p=2)),
    C("seed-negative", CMPL, ok(seed=-1)),
    C("seed-2e63", CMPL, ok(seed=2**63)),
    C("seed-max", CMPL, ok(seed=2**63 - 1), may_succeed=True),
    C("seed-float", CMPL, ok(seed=1.5)),
    C("n-nine", CMPL, ok(n=9)),
    C("n-two-streamed", CMPL, ok(n=2, stream=True)),
    C("n-two", CMPL, ok(n=2), may_succeed=True),
    C("n-zero", CMPL, ok(n=0)),
    C("n-true", CMPL, ok(n=True)),
    C("n-nan", CMPL, ok(n=NAN)),
    # -- booleans --------------------------------------------------------------------------------
    *[
        C(f"{name}-{label}", CMPL, ok(**{name: value}))
        for name in ("stream", "ignore_eos", "exact")
        for label, value in (("int", 1), ("string", "true"), ("list", [True]), ("obj", {}))
    ],
    C("stream-nan", CMPL, ok(stream=NAN)),
    C("stream-options-bad", CMPL, ok(stream=True, stream_options={"include_usage": "yes"})),
    C("stream-options-list", CMPL, ok(stream=True, stream_options=[])),
    C("stream-options-garbage-not-streaming", CMPL, ok(stream_options="x"), may_succeed=True),
    C("stream-ok", CMPL, ok(stream=True, stream_options={"include_usage": True}), may_succeed=True),
    C(
        "stream-chat-ok",
        CHAT,
        {"messages": MESSAGES, "max_tokens": 4, "stream": True},
        may_succeed=True,
    ),
    C("exact-true", CMPL, ok(exact=True), may_succeed=True),
    C("exact-stream", CMPL, ok(exact=True, stream=True), may_succeed=True),
    # -- stop ------------------------------------------------------------------------------------
    C("stop-too-many", CMPL, ok(stop=[f"s{i}" for i in range(17)])),
    C("stop-empty-string", CMPL, ok(stop="")),
    C("stop-empty-in-list", CMPL, ok(stop=["a", ""])),
    C("stop-number", CMPL, ok(stop=5)),
    C("stop-list-of-numbers", CMPL, ok(stop=[1, 2])),
    C("stop-object", CMPL, ok(stop={"a": "b"})),
    C("stop-nested", CMPL, ok(stop=[["a"]])),
    C("stop-16-long", CMPL, ok(stop=["x" * 100_000 + str(i) for i in range(16)]), may_succeed=True),
    C("stop-513-chars", CMPL, ok(stop="x" * 513), may_succeed=True),
    C("stop-special-token", CMPL, ok(stop=["<|im_end|>"]), may_succeed=True),
    # -- unsupported OpenAI fields, unknown fields, model ----------------------------------------
    C("best-of-2", CMPL, ok(best_of=2)),
    C("logit-bias", CMPL, ok(logit_bias={"50256": -100})),
    C("logprobs-5", CMPL, ok(logprobs=5), may_succeed=True),
    C("logprobs-0", CMPL, ok(logprobs=0), may_succeed=True),
    *[
        C(
            f"logprobs-20-{name}",
            CMPL,
            ok(prompt=PROMPT, logprobs=20, speculative=keys),
            may_succeed=True,
        )
        for name, keys in (
            ("ngram", {"strategy": "speculative", "drafter": "ngram", "k": 3}),
            ("dspark", {"strategy": "dspark", "drafter": "ngram"}),
            ("spork", {"strategy": "spork", "drafter": "recycle+ngram"}),
            ("spork-self", {"strategy": "spork", "drafter": "self", "forks": 2, "depth": 3}),
        )
    ],
    C(
        "logprobs-greedy-stream-stop",
        CMPL,
        ok(prompt=PROMPT, logprobs=3, temperature=0, stream=True, stop=[" three"], max_tokens=8),
        may_succeed=True,
    ),
    C("logprobs-1000", CMPL, ok(logprobs=1000)),
    C("logprobs-negative", CMPL, ok(logprobs=-1)),
    C("logprobs-nan", CMPL, ok(logprobs=NAN)),
    C("logprobs-string", CMPL, ok(logprobs="5")),
    C("logprobs-stream", CMPL, ok(logprobs=20, stream=True), may_succeed=True),
    C(
        "chat-top-logprobs-1000",
        CHAT,
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 1000},
    ),
    C(
        "chat-top-logprobs-without-logprobs",
        CHAT,
        {"messages": MESSAGES, "max_tokens": 4, "top_logprobs": 3},
        may_succeed=True,
    ),
    C("chat-logprobs-string", CHAT, {"messages": MESSAGES, "logprobs": "yes"}),
    C(
        "chat-logprobs-20-stream",
        CHAT,
        {
            "messages": MESSAGES,
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 20,
            "stream": True,
        },
        may_succeed=True,
    ),
    C("echo-true", CMPL, ok(echo=True)),
    C("suffix", CMPL, ok(suffix="x")),
    C("presence-penalty-nan", CMPL, ok(presence_penalty=NAN)),
    C(
        "tools",
        CHAT,
        {
            "messages": MESSAGES,
            "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        },
        may_succeed=True,
    ),
    C(
        "response-format-json",
        CHAT,
        {"messages": MESSAGES, "max_tokens": 4, "response_format": {"type": "json_object"}},
        may_succeed=True,
    ),
    C("response-format-string", CHAT, {"messages": MESSAGES, "response_format": "json"}),
    C("response-format-unknown", CHAT, {"messages": MESSAGES, "response_format": {"type": "x"}}),
    C(
        "response-format-no-schema",
        CHAT,
        {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
    ),
    C(
        "response-format-bad-schema",
        CHAT,
        {
            "messages": MESSAGES,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integr"}},
            },
        },
    ),
    C(
        "response-format-schema-list",
        CHAT,
        {
            "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
        },
    ),
    C("response-format-bad-regex", CMPL, ok(response_format={"type": "regex", "regex": "(("})),
    C(
        "response-format-huge-regex",
        CMPL,
        ok(response_format={"type": "regex", "regex": "a" * 200_000}),
    ),
    C("functions-field", CHAT, {"messages": MESSAGES, "functions": []}),
    C("unknown-field", CMPL, ok(max_token=4)),
    C("many-unknown-fields", CMPL, ok(**{f"f{i}": i for i in range(10_000)})),
    C("model-unknown", CMPL, ok(model="gpt-4")),
    C("model-list", CMPL, ok(model=[MODEL])),
    C("model-path", CMPL, ok(model="../../etc/passwd")),
    C("model-huge", CMPL, ok(model="m" * 1_000_000)),
    # -- the speculative object ------------------------------------------------------------------
    C("spec-string", CMPL, ok(speculative="fast")),
    C("spec-list", CMPL, ok(speculative=["spork"])),
    C("spec-true", CMPL, ok(speculative=True)),
    C("spec-unknown-key", CMPL, spec(strategy="spork", turbo=True)),
    C("spec-strategy-unknown", CMPL, spec(strategy="medusa")),
    C("spec-strategy-list", CMPL, spec(strategy=["spork"])),
    C("spec-strategy-number", CMPL, spec(strategy=1)),
    C("spec-empty", CMPL, spec(), may_succeed=True),
    C("spec-ar", CMPL, spec(strategy="ar"), may_succeed=True),
    # null inside speculative means "not given", as everywhere (docs/server.md)
    C("spec-nulls", CMPL, spec(strategy="speculative", k=None, weights=None), may_succeed=True),
    C("spec-strategy-null", CMPL, spec(strategy=None), may_succeed=True),
    C("spec-drafter-null", CMPL, spec(strategy="spork", drafter=None), may_succeed=True),
    C(
        "spec-recycle-persist",
        CMPL,
        greedy_spec(strategy="spork", drafter="recycle+ngram", recycle_persist=True),
        may_succeed=True,
    ),
    C(
        "exact-spork",
        CMPL,
        greedy_spec(strategy="spork", drafter="recycle+ngram") | {"exact": True},
        may_succeed=True,
    ),
    *[
        C(f"spec-{name}-{label}", CMPL, spec(strategy=SPEC_OWNER[name], **{name: value}))
        for name in SPEC_OWNER
        for label, value in (("nan", NAN), ("inf", INF))
    ],
    *[
        C(f"spec-{name}-{label}", CMPL, spec(strategy=SPEC_OWNER[name], **{name: value}))
        for name in ("k", "low", "tau", "margin_scale", "typical_delta")
        for label, value in (("neg-inf", -INF), ("string", "3"))
    ],
    *[  # a huge integer is a valid (if silly) scale
        C(
            f"spec-{name}-10e100",
            CMPL,
            spec(strategy=SPEC_OWNER[name], **{name: 10**100}),
            may_succeed=name in ("margin_scale", "typical_delta"),
        )
        for name in ("k", "low", "tau", "margin_scale", "typical_delta")
    ],
    C(
        "spec-k-1e400",
        CMPL,
        b'{"prompt": "hi", "max_tokens": 4, '
        b'"speculative": {"strategy": "speculative", "k": 1e400}}',
    ),
    C("spec-k-float", CMPL, spec(strategy="speculative", k=2.5)),
    C("spec-k-zero", CMPL, spec(strategy="speculative", k=0)),
    C("spec-k-negative", CMPL, spec(strategy="speculative", k=-3)),
    C("spec-k-bool", CMPL, spec(strategy="speculative", k=True)),
    C("spec-k-65", CMPL, spec(strategy="speculative", k=65)),
    C("spec-forks-zero", CMPL, spec(strategy="spork", forks=0)),
    C("spec-budget-below-depth", CMPL, spec(strategy="spork", depth=8, budget=4)),
    C("spec-min-k-above-max-k", CMPL, spec(strategy="dspark", min_k=8, max_k=2)),
    C("spec-low-above-high", CMPL, spec(strategy="dspark", low=0.9, high=0.1)),
    C("spec-weights-nan", CMPL, spec(strategy="dspark", weights=[NAN, 1, 1])),
    C("spec-weights-zero", CMPL, spec(strategy="dspark", weights=[0, 0, 0])),
    C("spec-weights-two", CMPL, spec(strategy="dspark", weights=[1, 1])),
    C("spec-weights-string", CMPL, spec(strategy="dspark", weights="1,1,1")),
    C("spec-weights-object", CMPL, spec(strategy="dspark", weights={"a": 1})),
    C("spec-tree-unknown", CMPL, spec(strategy="spork", tree="forest")),
    C("spec-k-policy-unknown", CMPL, spec(strategy="speculative", k_policy="fastest")),
    C("spec-k-policy-list", CMPL, spec(strategy="speculative", k_policy=["constant"])),
    *[
        C(f"spec-{name}-{label}", CMPL, spec(strategy=SPEC_BOOLS[name], **{name: value}))
        for name in SPEC_BOOLS
        for label, value in (("int", 1), ("string", "false"), ("nan", NAN))
    ],
    C("spec-option-of-other-strategy", CMPL, spec(strategy="dspark", forks=2)),
    C("spec-ar-with-k", CMPL, spec(strategy="ar", k=2)),
    C("spec-lossy-not-spork", CMPL, spec(strategy="speculative", lossy_typical=True)),
    C("spec-drafter-model-passwd", CMPL, spec(strategy="speculative", drafter="model:/etc/passwd")),
    C("spec-drafter-model-hub", CMPL, spec(strategy="speculative", drafter="model:gpt2")),
    C(
        "spec-drafter-spork-model",
        CMPL,
        spec(strategy="spork", drafter="recycle+model:/etc/passwd"),
    ),
    C("spec-drafter-empty", CMPL, spec(strategy="speculative", drafter="")),
    C("spec-drafter-empty-spork", CMPL, spec(strategy="spork", drafter="")),
    C("spec-drafter-plus", CMPL, spec(strategy="spork", drafter="+")),
    C("spec-drafter-unknown", CMPL, spec(strategy="speculative", drafter="medusa")),
    C("spec-drafter-recycle-chain", CMPL, spec(strategy="speculative", drafter="recycle")),
    C("spec-drafter-number", CMPL, spec(strategy="speculative", drafter=3)),
    C("spec-drafter-list", CMPL, spec(strategy="speculative", drafter=["ngram"])),
    C(
        "spec-drafter-ngram-x3",
        CMPL,
        spec(strategy="spork", drafter="ngram+ngram+ngram"),
        may_succeed=True,
    ),
    C(
        "spec-drafter-recycle-x2",
        CMPL,
        spec(strategy="spork", drafter="recycle+recycle"),
        may_succeed=True,
    ),
    C(
        "spec-self-layers-0-99999",
        CMPL,
        spec(strategy="speculative", drafter="self", self_layers="0-99999"),
    ),
    C(
        "spec-self-layers-0-9999",
        CMPL,
        spec(strategy="speculative", drafter="self", self_layers="0-9999"),
    ),
    C(
        "spec-self-layers-reversed",
        CMPL,
        spec(strategy="speculative", drafter="self", self_layers="5-2"),
    ),
    C(
        "spec-self-layers-negative",
        CMPL,
        spec(strategy="speculative", drafter="self", self_layers="-1"),
    ),
    C(
        "spec-self-layers-list",
        CMPL,
        spec(strategy="speculative", drafter="self", self_layers=[0, 1]),
    ),
    C(
        "spec-self-layers-redos",
        CMPL,
        spec(strategy="speculative", drafter="self", self_layers="0" + " " * 200_000 + "x"),
    ),
    C(
        "spec-self-layers-long-list",
        CMPL,
        spec(strategy="speculative", drafter="self", self_layers="0," * 100_000 + "x"),
    ),
    C(
        "spec-self-layers-repeated",
        CMPL,
        spec(strategy="speculative", drafter="self", self_layers=",".join(["0"] * 50_000)),
        may_succeed=True,
    ),
    C(
        "spec-self-and-skip",
        CMPL,
        spec(strategy="speculative", drafter="self", self_layers="0-3", skip_layers="4-5"),
    ),
    C(
        "spec-skip-all-layers",
        CMPL,
        spec(strategy="speculative", drafter="self", skip_layers="0-29"),
    ),
    C(
        "spec-skip-layers-empty",
        CMPL,
        spec(strategy="speculative", drafter="self", skip_layers=""),
        may_succeed=True,
    ),
    C("spec-recycle-prior-on", CMPL, spec(strategy="spork", recycle_prior=True)),
    # -- extreme but finite numbers that pass validation -----------------------------------------
    C(
        "spec-dspark-weights-1e308",
        CMPL,
        greedy_spec(strategy="dspark", weights=[1.79e308] * 3),
        may_succeed=True,
    ),
    C(
        "spec-dspark-weights-1e308-two",
        CMPL,
        greedy_spec(strategy="dspark", weights=[1.79e308, 1.79e308, 0]),
        may_succeed=True,
    ),
    C(
        "spec-dspark-low-high-1e308",
        CMPL,
        greedy_spec(strategy="dspark", low=-1e308, high=1e308),
        may_succeed=True,
    ),
    C(
        "spec-dspark-margin-scale-1e308",
        CMPL,
        spec(strategy="dspark", margin_scale=1e308),
        may_succeed=True,
    ),
    C(
        "spec-dspark-denormal-range",
        CMPL,
        greedy_spec(strategy="dspark", low=0.0, high=5e-324),
        may_succeed=True,
    ),
    C(
        "spec-dspark-tiny-range",
        CMPL,
        spec(strategy="dspark", low=0.5, high=0.5 + 1e-300),
        may_succeed=True,
    ),
    C(
        "spec-linear-decay-10e100",
        CMPL,
        spec(strategy="speculative", k_policy="linear-decay", expected_length=10**100),
        may_succeed=True,
    ),
    C(
        "spec-typical-delta-1e308",
        CMPL,
        ok(
            temperature=1,
            speculative={"strategy": "spork", "lossy_typical": True, "typical_delta": 1e308},
        ),
        may_succeed=True,
    ),
    C(
        "spec-sampled-top-k-10e100",
        CMPL,
        ok(
            temperature=1,
            top_k=10**100,
            speculative={"strategy": "spork", "drafter": "recycle+ngram"},
        ),
        may_succeed=True,
    ),
    # -- routes, methods, content types ----------------------------------------------------------
    C("get-on-completions", CMPL, method="GET", status=405),
    C("put-on-chat", CHAT, ok(), method="PUT", status=405),
    C("delete-on-completions", CMPL, method="DELETE", status=405),
    C("patch-on-models", "/v1/models", b"{}", method="PATCH", status=405),
    C("post-on-health", "/health", b"{}", status=405),
    C("post-on-models", "/v1/models", b"{}", status=405),
    C("options-on-completions", CMPL, method="OPTIONS", status=405),
    C("head-on-completions", CMPL, method="HEAD", status=405),
    C("unknown-route", "/v1/nothing", ok(), status=404),
    C("unknown-deep-route", "/v1/" + "a/" * 1000, ok(), status=404),
    C("model-route-unknown", "/v1/models/gpt-4", method="GET", status=404),
    C("model-route-traversal", "/v1/models/..%2F..%2Fetc%2Fpasswd", method="GET", status=404),
    C("model-route-empty", "/v1/models/", method="GET", status=404),
    C(
        "text-plain",
        CMPL,
        json.dumps(ok()).encode(),
        headers={"content-type": "text/plain"},
        may_succeed=True,
    ),
    C(
        "form-encoded",
        CMPL,
        b"prompt=hi&max_tokens=4",
        headers={"content-type": "application/x-www-form-urlencoded"},
    ),
    C(
        "multipart",
        CMPL,
        b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n--x--',
        headers={"content-type": "multipart/form-data; boundary=x"},
    ),
    C("no-content-type", CMPL, json.dumps(ok()).encode(), may_succeed=True),
    C(
        "gzip-claimed",
        CMPL,
        json.dumps(ok()).encode(),
        headers={"content-encoding": "gzip"},
        may_succeed=True,
    ),
    C(
        "host-header-foreign",
        CMPL,
        ok(),
        headers={"content-type": "application/json", "host": "evil.example"},
        may_succeed=True,
    ),
    C(
        "authorization-garbage",
        CMPL,
        ok(),
        headers={"content-type": "application/json", "authorization": "Bearer \x7f" + "a" * 10_000},
        may_succeed=True,
    ),
    C(
        "content-type-json-utf16",
        CMPL,
        json.dumps(ok()).encode(),
        headers={"content-type": "application/json; charset=utf-16"},
        may_succeed=True,
    ),
    C(
        "content-type-json-upper",
        CMPL,
        json.dumps(ok()).encode(),
        headers={"content-type": "APPLICATION/JSON"},
        may_succeed=True,
    ),
    C("body-9mb", CMPL, b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}', status=413),
]


@pytest.mark.parametrize("case", CORPUS)
def test_hostile_request(server: Server, case: Case) -> None:
    """One request of the corpus: a 4xx in the error shape or a bounded 200, no traceback."""
    before = len(server.log.lines)
    resp, _ = _send(server, case)
    _judge(server, case, resp, before)


# -- bodies httpx sends in odd ways ------------------------------------------------------------


def _chunks(data: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.mark.parametrize(
    ("data", "status"),
    [
        pytest.param(json.dumps(ok()).encode(), 200, id="chunked-valid"),
        pytest.param(b"{not json", 400, id="chunked-invalid"),
        pytest.param(b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}', 413, id="chunked-9mb"),
    ],
)
def test_chunked_body(server: Server, data: bytes, status: int) -> None:
    before = len(server.log.lines)
    resp = httpx.post(
        f"{server.url}{CMPL}",
        content=_chunks(data, 7919),
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    case = Case(CMPL, data, may_succeed=True, status=status)
    _judge(server, case, resp, before)


def _raw(server: Server, request: bytes, mode: str, timeout: float) -> bytes:
    """Send raw bytes on a fresh connection, then ("half-close") end the sending side and read,
    ("wait") read without ending it, or ("close") drop the connection; what came back."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    received = b""
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        if mode == "close":
            return received
        if mode == "half-close":
            sock.shutdown(socket.SHUT_WR)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            pass
    return received


POST_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
)
RAW = [
    pytest.param(
        POST_HEAD + b'Content-Length: 100\r\n\r\n{"prompt"',
        "half-close",
        id="body-shorter-than-content-length",
    ),
    pytest.param(
        POST_HEAD + b'Content-Length: 100\r\n\r\n{"prompt"',
        "close",
        id="client-gone-mid-body",
    ),
    pytest.param(
        POST_HEAD + b"Content-Length: abc\r\n\r\n{}", "half-close", id="content-length-not-a-number"
    ),
    pytest.param(
        POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        "half-close",
        id="bad-chunk-size",
    ),
    pytest.param(
        POST_HEAD + b"Content-Length: 9000000000\r\n\r\n",
        "wait",
        id="content-length-9gb-no-body",
        marks=pytest.mark.slow,
    ),
    pytest.param(b"GARBAGE\r\n\r\n", "half-close", id="not-http"),
    pytest.param(
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X: y\r\n" * 5000 + b"\r\n",
        "half-close",
        id="5000-headers",
    ),
    pytest.param(
        b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        "half-close",
        id="100k-url",
    ),
]


@pytest.mark.parametrize(("request_bytes", "mode"), RAW)
def test_raw_http(server: Server, request_bytes: bytes, mode: str) -> None:
    """Malformed HTTP: no 5xx (a 4xx, or the connection closed), no traceback in the server's
    log; a client that keeps its connection open ("wait") gets its answer without sending the
    body it announced."""
    before = len(server.log.lines)
    answer = _raw(server, request_bytes, mode, timeout=5.0)
    time.sleep(0.5)  # what the server logs once the connection is gone
    status_line = answer.split(b"\r\n", 1)[0]
    new_errors = server.log.lines[before:]
    assert answer or mode != "wait", "no answer while the client waited"
    assert not new_errors, f"{status_line!r}\nserver log:\n" + "\n".join(new_errors)
    if answer:  # uvicorn's own refusals are plain text: only the status is checked
        assert int(status_line.split()[1]) < 500, answer[:400]


# -- accepted requests whose cost max_tokens does not bound ----------------------------------------

AMPLIFY = [
    pytest.param(greedy_spec(strategy="ar"), id="reference-plain-8-tokens"),
    pytest.param(
        greedy_spec(
            strategy="spork",
            drafter="self",
            forks=64,
            depth=64,
            budget=64,
            adapt=False,
            goodput=False,
        ),
        id="spork-self-64x64",
    ),
    pytest.param(
        greedy_spec(
            strategy="spork",
            drafter="recycle+ngram+self",
            forks=64,
            depth=64,
            budget=64,
            goodput=False,
        ),
        id="spork-all-sources-64x64-adapt",
    ),
    pytest.param(
        greedy_spec(
            strategy="spork",
            drafter="self",
            forks=16,
            depth=16,
            budget=64,
            adapt=False,
            goodput=False,
        ),
        id="spork-self-16x16",
    ),
    pytest.param(
        greedy_spec(
            strategy="spork",
            drafter="self",
            self_layers="0-29",
            tree="dynamic",
            budget=64,
            depth=64,
            adapt=False,
            goodput=False,
        ),
        id="spork-self-full-model-dynamic-64",
    ),
    pytest.param(
        greedy_spec(
            strategy="speculative", drafter="self", self_layers="0-29", k=64, goodput=False
        ),
        id="speculative-self-full-model-k64",
    ),
    pytest.param(
        greedy_spec(
            strategy="dspark", drafter="self", self_layers="0-29", min_k=64, max_k=64, goodput=False
        ),
        id="dspark-self-full-model-k64",
    ),
    pytest.param(ok(prompt="a" * 7_000_000), id="tokenize-7mb-word"),
    pytest.param(ok(prompt="a " * 3_500_000), id="tokenize-7mb-words"),
    pytest.param(ok(prompt=[1] * 1_000_000), id="prompt-1m-token-ids"),
    pytest.param(ok(prompt=[1] * (CONTEXT - 5)), id="prefill-full-context"),
    pytest.param(
        {"messages": [{"role": "user", "content": "a"}] * 200_000, "max_tokens": 4},
        id="chat-200k-messages",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("body", AMPLIFY)
def test_compute_amplification(server: Server, body: dict, record_property: Any) -> None:
    """Requests that may be accepted although their work is far larger than their max_tokens
    (at most 8) suggests. Only a 5xx, a hang or a traceback fails; status and time are recorded
    (`pytest --junitxml`, to compare with reference-plain-8-tokens)."""
    path = CHAT if "messages" in body else CMPL
    case = Case(path, body, may_succeed=True)
    before = len(server.log.lines)
    resp, elapsed = _send(server, case)
    record_property("status", resp.status_code)
    record_property("elapsed_s", round(elapsed, 2))
    _judge(server, case, resp, before)


# -- many at once ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_burst_of_hostile_and_valid_requests(server: Server) -> None:
    """96 requests at once, a third of them valid greedy requests (plain and SPORK), the rest
    malformed: every answer a 200 or a 4xx (429 when the queue of 64 is full) in the error shape,
    no traceback, and every greedy answer that got through the text it had before."""
    bad = [c.values[0] for c in CORPUS if not c.marks and not c.values[0].may_succeed]
    bad = [
        c
        for c in bad
        if c.status is None and c.headers is None and len(_content(c.body) or b"") < 100_000
    ]
    greedy = [GREEDY["completion"], GREEDY["spork"]]

    def one(i: int) -> tuple[str, httpx.Response]:
        if i % 3 == 0:
            path, body = greedy[i // 3 % 2]
            case = Case(f"/v1/{path}", body, may_succeed=True)
        else:
            case = bad[i % len(bad)]
        return case.path, _send(server, case)[0]

    before = len(server.log.lines)
    with ThreadPoolExecutor(96) as pool:
        answers = list(pool.map(one, range(96)))
    assert not server.log.lines[before:], "\n".join(server.log.lines[before:])
    texts = set()
    for i, (path, resp) in enumerate(answers):
        assert resp.status_code < 500, (path, resp.status_code, resp.text[:300])
        if resp.status_code == 200:
            assert i % 3 == 0, (path, resp.text[:300])
            texts.add(resp.json()["choices"][0]["text"])
        else:
            _check_error_body(resp)
    assert texts <= {server.baseline["completion"], server.baseline["spork"]}, texts


# -- afterwards ------------------------------------------------------------------------------------


def test_server_still_answers_the_same(server: Server) -> None:
    """Runs last: the server is alive, its queue empty, its greedy answers unchanged."""
    health = httpx.get(f"{server.url}/health", timeout=TIMEOUT)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["queue_depth"] == 0
    models = httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).status_code == 200
    after = {name: _greedy_text(server.url, name) for name in GREEDY}
    assert after == server.baseline
