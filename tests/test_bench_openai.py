"""`openai:URL[#model]` bench baselines: a fake OpenAI-compatible server in a uvicorn thread.

The fake streams server-sent events as vLLM does (a role chunk, content chunks of several
tokens each, a finish chunk, a usage chunk, ``[DONE]``), so the tests check that tokens come
from the usage counts, not chunk counts, and that TTFT and decode time are taken at content
chunks (with a fake clock: no timing asserts). Servers that cannot be reached or do not speak
the API fail their row with the reason while the run goes on. The last test benchmarks
``specfork serve`` itself (the tiny model) against the same engine in-process.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from specfork.bench.openai_api import OpenAIServer, ServerAnswerError, openai_runner
from specfork.bench.prompts import BenchPrompt
from specfork.bench.quality import compare_text
from specfork.bench.records import PreparedPrompt
from specfork.bench.report import write_report_md
from specfork.bench.runner import BenchSettings, run_benchmark
from specfork.bench.specs import parse_strategies, parse_strategy
from specfork.config import GenerationConfig, SamplingParams
from specfork.errors import ConfigError
from specfork.server.run import serve_in_background
from tiny_models import tiny_chat_llama


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-openai"))


def _chunk(delta: dict | None = None, finish: str | None = None, **extra: Any) -> str:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "fake-model",
        "choices": choices,
        **extra,
    }
    return f"data: {json.dumps(body)}\n\n"


def fake_server(answers: dict[str, str], requests: list[dict], usage: bool = True) -> FastAPI:
    """Lists "fake-model"; answers a chat whose last user message is a key of `answers` with
    that text in three content chunks (several tokens each), 12 completion tokens."""
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        requests.append(body)
        text = answers.get(body["messages"][-1]["content"], "something else entirely")
        third = len(text) // 3

        def events() -> Iterator[str]:
            yield _chunk({"role": "assistant", "content": ""})
            for piece in (text[:third], text[third : 2 * third], text[2 * third :]):
                yield _chunk({"content": piece})
            yield _chunk({}, finish="length")
            if usage:
                counts = {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}
                yield _chunk(None, usage=counts)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _prompt(text: str = "Hello?") -> PreparedPrompt:
    return PreparedPrompt(
        0, BenchPrompt(1, "qa", text), [1, 2], 1, [{"role": "user", "content": text}], True
    )


class Clock:
    """A clock that advances one second per reading."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


# ----------------------------------------------------------------------------- specs


def test_openai_spec_parsing() -> None:
    s = parse_strategy("openai:http://127.0.0.1:8000/v1#Qwen/Qwen3-0.6B")
    assert (s.family, s.label) == ("openai", "openai:http://127.0.0.1:8000/v1#Qwen/Qwen3-0.6B")
    assert s.options == {"url": "http://127.0.0.1:8000/v1", "model": "Qwen/Qwen3-0.6B"}
    assert parse_strategy("openai:https://host/v1").options["model"] is None
    specs = parse_strategies("ar,openai:http://h:1/v1#m,speculative:ngram")
    assert [x.family for x in specs] == ["specfork", "openai", "specfork"]
    for bad, words in (
        ("openai:localhost:8000", "http(s) API base URL"),
        ("openai:ftp://h/v1", "http(s) API base URL"),
        ("openai:http://h/v1#", "nothing after '#'"),
        ("openai:http://h/v1?k=3", "takes no options"),
    ):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_strategy(bad)


def test_text_comparison() -> None:
    assert compare_text("abc", "abc").status == "text-equal"
    differs = compare_text("abc", "abd")
    assert (differs.status, differs.position) == ("text-differs", 2)
    assert compare_text("ab", "abc").position == 2
    # a character cut by the token limit: U+FFFD here, held back by a streaming decoder there
    assert compare_text("ab\ufffd\ufffd", "ab").status == "text-equal"


# ----------------------------------------------------------------------------- measuring


def test_tokens_from_usage_ttft_and_decode_time_at_content_chunks() -> None:
    requests: list[dict] = []
    app = fake_server({"Hello?": "Hi there, friend."}, requests)
    with serve_in_background(app) as url:
        server = OpenAIServer(f"{url}/v1")
        assert server.first_model() == "fake-model"
        sampling = SamplingParams(temperature=0.0, seed=3)
        run = openai_runner(server, "fake-model", 32, sampling, ignore_eos=True, clock=Clock())
        out = run(_prompt())
    # clock: t0=101, role chunk 102, content chunks 103-105, finish 106, usage 107, end 108
    assert out.new_tokens == 12  # the usage count, not the 3 content chunks
    assert out.time_to_first_token == 2.0  # request start → first chunk WITH content
    assert out.decode_tokens_per_second == pytest.approx(11 / 2.0)  # (12 − 1) / (105 − 103)
    assert out.wall_seconds == 7.0 and out.finish_reason == "length"
    assert out.text == "Hi there, friend." and out.token_ids == []
    body = requests[0]
    assert body["messages"] == [{"role": "user", "content": "Hello?"}]
    assert (body["model"], body["max_tokens"], body["temperature"], body["seed"]) == (
        "fake-model",
        32,
        0.0,
        3,
    )
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True


def test_no_usage_chunk_fails_the_run_with_the_reason() -> None:
    app = fake_server({}, [], usage=False)
    with serve_in_background(app) as url:
        run = openai_runner(OpenAIServer(f"{url}/v1"), "m", 8, SamplingParams(), False)
        with pytest.raises(ServerAnswerError, match="no usage chunk with completion_tokens"):
            run(_prompt())


def _not_openai() -> FastAPI:
    app = FastAPI()

    @app.get("/html/v1/models")
    def html_models() -> HTMLResponse:
        return HTMLResponse("<html><body>Welcome to my blog</body></html>")

    @app.get("/json/v1/models")
    def json_models() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/json/v1/chat/completions")
    def json_chat() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.usefixtures("one_thread")
def test_bad_servers_fail_their_rows_and_the_run_goes_on(tiny_folder: Path) -> None:
    from specfork.loading.loader import load_model

    loaded = load_model(str(tiny_folder), dtype="float32", device="cpu", progress=False)
    with serve_in_background(_not_openai()) as url:
        dead = f"openai:http://127.0.0.1:{_free_port()}/v1"
        html, listing = f"openai:{url}/html/v1", f"openai:{url}/json/v1"
        chat = f"openai:{url}/json/v1#some-model"  # the model is named: /models is not asked
        missing = f"openai:{url}#m"  # forgot the /v1
        specs = parse_strategies(",".join(["ar", dead, html, listing, chat, missing]))
        settings = BenchSettings(
            specs, [BenchPrompt(1, "qa", "Hi")], max_new_tokens=4, repeats=1, warmup=1
        )
        results = run_benchmark(settings, loaded=loaded, show_progress=False)
    errors = {s.label: s.error for s in results.strategies}
    assert {s.label: s.status for s in results.strategies} == {
        "ar": "ok",
        dead: "failed",
        html: "failed",
        listing: "failed",
        chat: "failed",
        missing: "failed",
    }
    assert "cannot reach" in errors[dead] and "ConnectError" in errors[dead]
    assert "text/html" in errors[html] and "not an OpenAI-compatible API" in errors[html]
    assert "lists no models" in errors[listing]
    assert errors[chat].startswith("warm-up failed")
    assert "application/json, not a stream of server-sent events" in errors[chat]
    assert "HTTP 404" in errors[missing] and "/v1" in errors[missing]
    assert [m.strategy for m in results.measurements] == ["ar"]  # the run went on
    assert all(any(label in n for n in results.notes) for label in (dead, html, chat))


@pytest.mark.usefixtures("one_thread")
def test_text_match_and_speedup_through_the_bench(tiny_folder: Path, tmp_path: Path) -> None:
    """The fake answers one prompt with ar's own text and the other with something else."""
    from specfork.engine.generator import Generator
    from specfork.loading.loader import load_model

    loaded = load_model(str(tiny_folder), dtype="float32", device="cpu", progress=False)
    gen = Generator(loaded)
    texts = ["Say: the cat sat.", "Why is the sky blue?"]
    ar_ids = gen.generate(texts[0], config=GenerationConfig(max_new_tokens=12)).token_ids
    ar_text = loaded.tokenizer.decode(ar_ids, skip_special_tokens=True)
    requests: list[dict] = []
    with serve_in_background(fake_server({texts[0]: ar_text}, requests)) as url:
        label = f"openai:{url}/v1"
        settings = BenchSettings(
            parse_strategies(f"ar,{label}"),
            [BenchPrompt(i, "qa", t) for i, t in enumerate(texts)],
            max_new_tokens=12,
            repeats=2,
            warmup=1,
        )
        results = run_benchmark(settings, loaded=loaded, show_progress=False)
    assert [s.status for s in results.strategies] == ["ok", "ok"]
    assert len(requests) == 1 + 2 * 2  # warm-up, then 2 prompts × 2 repeats
    assert all(r["max_tokens"] == 12 and "ignore_eos" not in r for r in requests)
    rows = {r["prompt_index"]: r for r in results.per_prompt if r["strategy"] == label}
    assert rows[0]["greedy_match"] == "text-equal" and rows[0]["divergence_position"] is None
    assert rows[1]["greedy_match"] == "text-differs"
    assert rows[0]["speedup"] > 0 and rows[0]["target_logprob"] is None
    cell = results.summary[label]["overall"]
    assert cell["greedy_match_rate"] == 0.5 and cell["match_basis"] == "text"
    assert "match_basis" not in results.summary["ar"]["overall"]
    m = next(m for m in results.to_dict()["measurements"] if m["strategy"] == label)
    assert m["new_tokens"] == 12 and m["text"] and m["turn"] == 1
    assert any("information only" in n for n in results.notes)
    report = write_report_md(results.to_dict(), tmp_path).read_text()
    assert "| 50% (text) |" in report and "information only" in report


@pytest.mark.usefixtures("one_thread")
def test_specfork_serve_as_the_server(tiny_folder: Path, tmp_path: Path) -> None:
    """specfork serve on the same tiny model: same engine, so the text matches ar's, and a
    multi-turn run sends the same earlier answer to the server."""
    from specfork.engine.generator import Generator
    from specfork.loading.loader import load_model
    from specfork.server.app import create_app

    loaded = load_model(str(tiny_folder), dtype="float32", device="cpu", progress=False)
    served = load_model(str(tiny_folder), dtype="float32", device="cpu", progress=False)
    app = create_app(Generator(served), model_name="tiny", queue_size=4)
    prompts = [BenchPrompt(1, "writing", "Say: the cat sat.", ("Again.",))]
    with serve_in_background(app) as url:
        label = f"openai:{url}/v1"
        settings = BenchSettings(
            parse_strategies(f"ar,{label}"),
            prompts,
            max_new_tokens=8,
            ignore_eos=True,
            repeats=1,
            warmup=1,
            turns="all",
        )
        results = run_benchmark(settings, loaded=loaded, show_progress=False)
    assert [s.status for s in results.strategies] == ["ok", "ok"], results.notes
    assert results.strategies[1].description["model"] == "tiny"
    rows = [r for r in results.per_prompt if r["strategy"] == label]
    assert [(r["turn"], r["greedy_match"]) for r in rows] == [(1, "text-equal"), (2, "text-equal")]
    served_runs = [m for m in results.measurements if m.strategy == label]
    assert [m.output.new_tokens for m in served_runs] == [8, 8]  # ignore_eos honoured
