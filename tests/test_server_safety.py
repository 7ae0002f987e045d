"""`specfork serve` safe by default: who may call it, how much one request may cost, and the
conventions tooling expects (log-probabilities, vLLM's metric names).

Real-model servers check what a client sees; scheduling details (the queue) run on the fake
engine of test_server.py, so nothing depends on timing.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from rich.console import Console

from specfork.cli import serve as serve_command
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.engine.generator import Generator
from specfork.errors import SpecforkError
from specfork.loading.loader import LoadedModel
from specfork.server.app import create_app
from specfork.server.metrics import ServerMetrics
from specfork.server.run import serve_in_background
from specfork.server.security import host_name
from specfork.server.worker import EngineWorker, Job, ServerSettings
from test_server import CURVE, MODEL, FakeEngine, _serve_args, _until

HTTP = httpx.Client(timeout=120)  # generous: a loaded CI machine must not turn into failures
KEY = "sk-test-0123456789"
PROMPT = "Repeat exactly: one two three, one two three, one two three,"
CHAT = [{"role": "user", "content": "List the numbers one to five, then again."}]
NGRAM = {"strategy": "speculative", "drafter": "ngram", "k": 3}


@pytest.fixture(scope="module")
def guarded(smollm_f32: LoadedModel) -> Iterator[str]:
    """A real server with an API key and the vLLM metric prefix (rows priced by a fixed
    curve, not timed ones: the vLLM counters' test needs its drafts on any machine)."""
    app = create_app(
        Generator(smollm_f32, max_context=1024, cost_curve=CURVE),
        model_name=MODEL,
        api_key=KEY,
        metrics_prefix="vllm:",
    )
    with serve_in_background(app) as url:
        yield url


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- access ----------------------------------------------------------------------------------------


def test_an_api_key_is_required_on_v1_and_only_there(guarded: str) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, _auth("sk-wrong"), {"Authorization": KEY}, {"Authorization": "Basic x"}):
        resp = HTTP.post(f"{guarded}/v1/completions", json=body, headers=headers)
        assert resp.status_code == 401, headers
        assert resp.headers["www-authenticate"] == "Bearer"
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert "Authorization: Bearer" in resp.json()["error"]["message"]
    assert HTTP.get(f"{guarded}/v1/models").status_code == 401
    assert HTTP.get(f"{guarded}/v1/models", headers=_auth()).status_code == 200
    assert HTTP.post(f"{guarded}/v1/completions", json=body, headers=_auth()).status_code == 200
    assert HTTP.get(f"{guarded}/health").status_code == 200  # probes and scrapers stay open
    assert HTTP.get(f"{guarded}/metrics").status_code == 200
    client = openai.OpenAI(base_url=f"{guarded}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded}/v1", api_key="sk-no", max_retries=0).models.list()


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_only_json_bodies_are_read(guarded: str, content_type: str | None) -> None:
    """A browser's simple POST (text/plain, forms: no CORS preflight) never runs a request."""
    headers = _auth() | ({"content-type": content_type} if content_type else {})
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    resp = HTTP.post(f"{guarded}/v1/completions", content=body, headers=headers)
    assert resp.status_code == 415, resp.text
    assert resp.json()["error"]["code"] == "unsupported_media_type"
    ok = {**headers, "content-type": "Application/JSON; charset=utf-8"}
    assert HTTP.post(f"{guarded}/v1/completions", content=body, headers=ok).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", ""])
def test_other_host_names_are_refused(guarded: str, host: str) -> None:
    """DNS rebinding: a page whose name now points at 127.0.0.1 sends its own Host."""
    resp = HTTP.get(f"{guarded}/health", headers={"host": host})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_host"
    for fine in ("localhost", "localhost:9", "127.0.0.1:1234", "[::1]:80", "LOCALHOST"):
        assert HTTP.get(f"{guarded}/health", headers={"host": fine}).status_code == 200, fine


def test_host_names_are_parsed_like_browsers_send_them() -> None:
    assert host_name("LocalHost:8000") == "localhost"
    assert host_name("[::1]:8000") == "::1"
    assert host_name("[::1]") == "::1"
    assert host_name("::1") == "::1"  # a bare IPv6 address has no port
    assert host_name("example.com") == "example.com"


def test_serve_flags_for_access_and_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _serve_args()
    settings = serve_command.security_settings(args)
    assert settings["api_key"] is None and settings["allowed_hosts"] == (
        "localhost",
        "127.0.0.1",
        "::1",
    )
    assert settings["max_draft_nodes"] == 256 and settings["request_timeout"] == 300.0
    assert not settings["fixed_strategy"] and not settings["allow_lossy"]
    wildcard = serve_command.security_settings(_serve_args("--host", "0.0.0.0", "--api-key", "k"))
    assert wildcard["allowed_hosts"] == ("*",)  # the key guards it; any name may reach it
    named = serve_command.security_settings(_serve_args("--host", "10.0.0.5"))
    assert "10.0.0.5" in named["allowed_hosts"]
    listed = serve_command.security_settings(_serve_args("--allowed-hosts", "a.example, b"))
    assert listed["allowed_hosts"] == ("a.example", "b")
    monkeypatch.setenv("SPECFORK_API_KEY", "from-env")
    assert serve_command.security_settings(_serve_args())["api_key"] == "from-env"
    console = Console(stderr=True)
    for argv, message in [
        (("--api-key", " spaced "), "API key"),
        (("--allowed-hosts", "a,,b"), "allowed hosts"),
        (("--request-timeout", "0"), "request_timeout"),
        (("--max-draft-nodes", "0"), "max_draft_nodes"),
        (("--metrics-prefix", "9bad"), "metrics prefix"),
        (("--max-running", "0"), "max_running"),
        (("--prefix-cache-mb", "-1"), "prefix_cache_mb"),
        (("--stream-interval", "-0.5"), "stream_interval"),
        (("--kv-budget-mb", "0"), "kv_budget_mb"),
        (("--step-rows", "4"), r"step_rows \(4\) must hold at least one row per running"),
        (("--step-rows", "0"), "step_rows must be an integer >= 1"),
    ]:
        with pytest.raises(SpecforkError, match=message):  # before any model is loaded
            serve_command.run(_serve_args("-m", "no-such-model", *argv), console)


# -- bounded work ----------------------------------------------------------------------------------


def test_limits_on_what_a_request_may_ask(smollm_f32: LoadedModel) -> None:
    """--fixed-strategy refuses any speculative object; --allow-lossy lets a request opt into
    typical acceptance, and the response says it was lossy; a joint budget on drafted tokens
    per round (forks × depth) with its own bound."""
    gen = Generator(smollm_f32, max_context=1024)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    fixed = create_app(gen, model_name=MODEL, fixed_strategy=True)
    with serve_in_background(fixed) as url:
        resp = HTTP.post(f"{url}/v1/completions", json={**body, "speculative": NGRAM})
        assert resp.status_code == 400 and "--fixed-strategy" in resp.json()["error"]["message"]
        assert HTTP.post(f"{url}/v1/completions", json=body).status_code == 200
    lossy = {"strategy": "spork", "lossy_typical": True}
    permissive = create_app(gen, model_name=MODEL, allow_lossy=True, max_draft_nodes=16)
    with serve_in_background(permissive) as url:
        resp = HTTP.post(f"{url}/v1/completions", json={**body, "speculative": lossy})
        assert resp.status_code == 400  # spork's default tree, 8 × 8 when adapting, is over 16
        assert "16 (--max-draft-nodes)" in resp.json()["error"]["message"]
        small = {**lossy, "forks": 2, "depth": 2}
        resp = HTTP.post(f"{url}/v1/completions", json={**body, "speculative": small})
        assert resp.status_code == 200, resp.text
        assert resp.json()["speculative"]["lossless"] is False
        resp = HTTP.post(f"{url}/v1/completions", json={**body, "speculative": NGRAM})
        assert resp.json()["speculative"]["lossless"] is True


def test_a_request_past_its_deadline_ends_and_the_next_is_served(smollm_f32) -> None:
    gen = Generator(smollm_f32, max_context=1024)
    app = create_app(gen, model_name=MODEL, request_timeout=0.2)
    body = {"prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    with serve_in_background(app) as url:
        resp = HTTP.post(f"{url}/v1/completions", json=body, timeout=60)
        out = resp.json()
        assert resp.status_code == 200
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["speculative"]["time_limit_reached"] is True
        assert 1 <= out["usage"]["completion_tokens"] < 900
        short = HTTP.post(f"{url}/v1/completions", json={**body, "max_tokens": 3})
        assert short.status_code == 200  # served; on a loaded machine it may meet the deadline
        done = short.json()
        assert 1 <= done["usage"]["completion_tokens"] <= 3
        if not done["speculative"]["time_limit_reached"]:
            assert done["usage"]["completion_tokens"] == 3


def test_a_cancelled_job_leaves_the_queue_at_once() -> None:
    """One client cannot hold queue places with requests it gave up on."""

    async def scenario() -> None:
        engine = FakeEngine(SpecConfig())
        metrics = ServerMetrics()
        worker = EngineWorker(engine, metrics, ServerSettings(MODEL, queue_size=2))
        config, sampling = GenerationConfig(max_new_tokens=2), SamplingParams()
        jobs = [Job([1], config, sampling, None, deltas=False) for _ in range(3)]
        worker.submit(jobs[0])
        worker.submit(jobs[1])
        with pytest.raises(Exception, match="busy"):
            worker.submit(jobs[2])
        jobs[0].cancel()
        assert worker.depth == 1
        worker.submit(jobs[2])  # the freed place
        assert worker.depth == 2
        assert metrics.cancelled._value.get() == 1
        jobs[0].cancel()  # twice is once
        assert metrics.cancelled._value.get() == 1

    asyncio.run(scenario())


# -- log-probabilities -----------------------------------------------------------------------------


def _library_logprobs(smollm_f32: LoadedModel, prompt, chat: bool, n: int, spec=None) -> list:
    gen = Generator(smollm_f32, max_context=1024)
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True, logprobs=n)
    return gen.generate(prompt, chat=chat, config=config, spec=spec).logprobs


@pytest.mark.parametrize("speculative", [None, NGRAM], ids=["plain", "ngram"])
def test_completion_logprobs_are_the_targets(guarded: str, smollm_f32, speculative) -> None:
    """The numbers plain decoding computes (raw log-softmax of the target's logits), in the
    completions shape, whole and streamed."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= {"logprobs": 3} | ({"speculative": speculative} if speculative else {})
    whole = HTTP.post(f"{guarded}/v1/completions", json=body, headers=_auth()).json()
    lp = whole["choices"][0]["logprobs"]
    ref = _library_logprobs(smollm_f32, PROMPT, False, 3)
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in ref], abs=1e-4)
    assert len(lp["tokens"]) == len(lp["top_logprobs"]) == whole["usage"]["completion_tokens"]
    assert "".join(lp["tokens"]) == whole["choices"][0]["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(len(top) <= 3 for top in lp["top_logprobs"])
    streamed = _stream_chunks(guarded, "completions", {**body, "stream": True})
    tokens = [t for c in streamed for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    values = [
        v for c in streamed for v in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])
    ]
    assert tokens == lp["tokens"] and values == lp["token_logprobs"]


def test_chat_logprobs_are_the_targets(guarded: str, smollm_f32) -> None:
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= {"logprobs": True, "top_logprobs": 2}
    client = openai.OpenAI(base_url=f"{guarded}/v1", api_key=KEY, max_retries=0)
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    ref = _library_logprobs(smollm_f32, CHAT, True, 2)
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in ref], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(bytes(c.bytes).decode("utf-8", "replace") == c.token for c in content)
    no_top = HTTP.post(
        f"{guarded}/v1/chat/completions", json={**body, "top_logprobs": 0}, headers=_auth()
    ).json()
    assert all(e["top_logprobs"] == [] for e in no_top["choices"][0]["logprobs"]["content"])
    streamed = _stream_chunks(guarded, "chat/completions", {**body, "stream": True})
    entries = [
        e
        for c in streamed
        if c["choices"]
        for e in (c["choices"][0]["logprobs"] or {}).get("content", [])
    ]
    assert [e["logprob"] for e in entries] == [c.logprob for c in content]
    off_body = {**body, "logprobs": False, "top_logprobs": 0}
    off = HTTP.post(f"{guarded}/v1/chat/completions", json=off_body, headers=_auth()).json()
    assert off["choices"][0]["logprobs"] is None


def _stream_chunks(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/{path}", json=body, headers=_auth(), timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


# -- vLLM's metric names ---------------------------------------------------------------------------


def _counter(url: str, name: str) -> dict[str, float]:
    """Values of one counter by its label set."""
    text = HTTP.get(f"{url}/metrics").text
    found = re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE)
    return {labels: float(value) for labels, value in found}


def test_speculative_decoding_is_counted_under_vllm_names(guarded: str) -> None:
    before = _counter(guarded, "vllm:spec_decode_num_accepted_tokens_total")
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    resp = HTTP.post(
        f"{guarded}/v1/completions", json={**body, "speculative": NGRAM}, headers=_auth()
    ).json()
    stats = resp["speculative"]
    assert stats["accepted"] > 0
    labels = f'engine="0",model_name="{MODEL}"'
    accepted = _counter(guarded, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted[labels] - before.get(labels, 0.0) == stats["accepted"]
    drafts = _counter(guarded, "vllm:spec_decode_num_drafts_total")[labels]
    tokens = _counter(guarded, "vllm:spec_decode_num_draft_tokens_total")[labels]
    assert drafts >= 1 and tokens >= stats["drafted"]
    per_pos = _counter(guarded, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert sum(per_pos.values()) == accepted[labels]  # every accepted token has a position
    first = per_pos[f'{labels},position="0"']
    assert all(v <= first for v in per_pos.values())  # a later position needs the ones before
    assert not _counter(guarded, "specfork:spec_decode_num_drafts_total")  # the prefix is vllm:


def test_no_stall_beyond_the_deadline_for_the_next_client(smollm_f32) -> None:
    """A client that asks for the most work the server allows holds the worker no longer
    than the deadline; the next client is then answered."""
    gen = Generator(smollm_f32, max_context=1024)
    app = create_app(gen, model_name=MODEL, request_timeout=1.0)
    heavy = {"strategy": "spork", "drafter": "recycle+self", "skip_layers": "4-25"}
    heavy |= {"tree": "dynamic", "budget": 64, "forks": 8, "depth": 8, "adapt": False}
    body = {"prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    with serve_in_background(app) as url:
        resp = HTTP.post(f"{url}/v1/completions", json={**body, "speculative": heavy}, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["speculative"]["time_limit_reached"] is True
        nxt = HTTP.post(f"{url}/v1/completions", json={**body, "max_tokens": 2}, timeout=120)
        assert nxt.status_code == 200 and nxt.json()["usage"]["completion_tokens"] == 2


class SilentEngine(FakeEngine):
    """Each request runs rounds that show no text (all held back) until it is cancelled."""

    def __init__(self) -> None:
        super().__init__(SpecConfig(), gated=False)
        self.rounds = 0

    def stream(self, prompt, *, config, sampling, spec):  # type: ignore[override]
        engine = self

        class Silent:
            result = None
            logprobs = None

            def rounds(self) -> Iterator[str]:
                while True:
                    engine.rounds += 1
                    time.sleep(0.005)
                    yield ""

        return Silent()


def test_a_client_gone_while_text_is_held_back_stops_its_generation() -> None:
    """Cancellation is checked every round, also rounds that show nothing (a stop string
    holding text back), so a silent generation does not outlive its client."""
    engine = SilentEngine()
    app = create_app(engine, model_name=MODEL)
    with serve_in_background(app) as url:
        body = {"prompt": "hi", "max_tokens": 8, "stream": True}
        with pytest.raises(httpx.ReadTimeout):
            HTTP.post(f"{url}/v1/completions", json=body, timeout=1.0)
        _until(lambda: _cancelled(url) == 1, "the generation to be cancelled")
        seen = engine.rounds
        time.sleep(0.2)
        assert engine.rounds == seen  # no round ran after the cancellation


def _cancelled(url: str) -> float:
    text = HTTP.get(f"{url}/metrics").text
    found = re.search(r"^specfork_generations_cancelled_total (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_top_k_minus_one_means_off(guarded: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.7, "seed": 3}
    off = HTTP.post(f"{guarded}/v1/completions", json={**body, "top_k": -1}, headers=_auth())
    zero = HTTP.post(f"{guarded}/v1/completions", json={**body, "top_k": 0}, headers=_auth())
    assert off.status_code == 200
    assert off.json()["choices"][0]["text"] == zero.json()["choices"][0]["text"]
