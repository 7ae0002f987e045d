"""Any OpenAI-compatible server as a baseline: ``openai:URL[#model]`` (vLLM, SGLang,
llama-server, ``specfork serve`` itself).

The bench streams the same prompts through the running server: the chat completions API with
the same messages (a later turn carries the same earlier answers), or the completions API with
the same text when the bench runs without a chat template; ``max_tokens`` = the bench's ``-n``,
its temperature (and seed), ``stream_options: {"include_usage": true}``, and ``ignore_eos``
as an extra body field when the bench ignores EOS (vLLM and ``specfork serve`` honour it;
other servers may ignore it). Without ``#model`` the server's first ``/models`` entry is used.
``OPENAI_API_KEY``, when set, is sent as the bearer token.

Measured from the client's side, as a user of that server sees it:

- tokens: the final usage chunk's ``completion_tokens`` (never a count of chunks: a server may
  put several tokens in one chunk);
- time to first token: request sent → first chunk with content;
- decode tokens/s: (completion_tokens − 1) / (last content chunk − first content chunk).

The output is text (another engine's tokenizer is not ours), so its match with ``ar`` compares
text and is information only. A server that cannot be reached or does not answer as the OpenAI
API does fails its row with the reason; the run goes on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from specfork.bench.records import BenchStrategy, PreparedPrompt, RunOutput
from specfork.bench.specs import StrategySpec
from specfork.checks import is_int
from specfork.config import SamplingParams

INSTALL = "pip install 'specfork[bench]'"
CONNECT_TIMEOUT = 10.0  # seconds to reach the server
READ_TIMEOUT = 600.0  # seconds between two streamed chunks at most
_EXCERPT = 160  # characters of an unexpected answer shown in an error


class ServerAnswerError(RuntimeError):
    """The server answered, but not as an OpenAI-compatible API does (the message says how)."""


def httpx_available() -> bool:
    return importlib.util.find_spec("httpx") is not None


class OpenAIServer:
    """An OpenAI-compatible API at `base_url` (e.g. ``http://127.0.0.1:8000/v1``)."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        try:
            import httpx
        except ImportError as exc:
            raise ImportError(f"openai: baselines need httpx ({INSTALL})") from exc
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT)
        self._client = httpx.Client(timeout=timeout, headers=headers)
        self._httpx = httpx

    def close(self) -> None:
        self._client.close()

    def first_model(self) -> str:
        """The id of the first model ``GET /models`` lists."""
        url = f"{self.base_url}/models"
        response = self._request("GET", url)
        body = _json_object(response, url)
        data = body.get("data")
        if not isinstance(data, list) or not data:
            raise ServerAnswerError(
                f"{url} lists no models ('data' is {_short(data)}); "
                "not an OpenAI-compatible API, or name one with #model"
            )
        first = data[0]
        if not isinstance(first, dict) or not isinstance(first.get("id"), str):
            raise ServerAnswerError(f"{url}: the first model has no 'id': {_short(first)}")
        return first["id"]

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST `body` with ``stream: true``; yields each server-sent event's JSON object."""
        url = f"{self.base_url}{path}"
        try:
            with self._client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise ServerAnswerError(_status_error(response, url))
                kind = response.headers.get("content-type", "")
                if "text/event-stream" not in kind:
                    response.read()
                    raise ServerAnswerError(
                        f"{url} answered {kind or 'no content type'}, not a stream of "
                        f"server-sent events: not an OpenAI-compatible API? "
                        f"({_short(response.text)})"
                    )
                yield from _events(response.iter_lines(), url)
        except self._httpx.HTTPError as exc:
            raise ServerAnswerError(_transport_error(exc, url)) from exc

    def _request(self, method: str, url: str) -> Any:
        try:
            response = self._client.request(method, url)
        except self._httpx.HTTPError as exc:
            raise ServerAnswerError(_transport_error(exc, url)) from exc
        if response.status_code != 200:
            raise ServerAnswerError(_status_error(response, url))
        return response


def _events(lines: Iterator[str], url: str) -> Iterator[dict[str, Any]]:
    """The JSON objects of ``data:`` lines until ``data: [DONE]`` (other SSE fields skipped)."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise ServerAnswerError(
                f"{url} streamed data that is not JSON: {_short(data)}"
            ) from None
        if not isinstance(event, dict):
            raise ServerAnswerError(f"{url} streamed {_short(event)}, not a JSON object")
        if "error" in event:
            raise ServerAnswerError(f"{url} streamed an error: {_short(event['error'])}")
        yield event


def _json_object(response: Any, url: str) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        kind = response.headers.get("content-type", "no content type")
        raise ServerAnswerError(
            f"{url} answered {kind}, not JSON: not an OpenAI-compatible API? "
            f"({_short(response.text)})"
        ) from None
    if not isinstance(body, dict):
        raise ServerAnswerError(f"{url} answered {_short(body)}, not a JSON object")
    return body


def _status_error(response: Any, url: str) -> str:
    hint = (
        " (is the URL the API's base, e.g. http://host:8000/v1?)"
        if response.status_code in (404, 405)
        else ""
    )
    return f"{url} answered HTTP {response.status_code}{hint}: {_short(response.text)}"


def _transport_error(exc: Exception, url: str) -> str:
    return f"cannot reach {url}: {type(exc).__name__}: {exc or 'no details'}"


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = " ".join(text.split())
    return text if len(text) <= _EXCERPT else text[: _EXCERPT - 1] + "…"


def request_body(model: str, n: int, sampling: SamplingParams, ignore_eos: bool) -> dict[str, Any]:
    """What every request sends besides the prompt."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": n,
        "temperature": sampling.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if ignore_eos:
        body["ignore_eos"] = True  # not in the OpenAI API: vLLM and specfork serve take it
    return body


def openai_runner(
    server: OpenAIServer,
    model: str,
    n: int,
    sampling: SamplingParams,
    ignore_eos: bool,
    clock: Callable[[], float] = time.perf_counter,
) -> Callable[[PreparedPrompt], RunOutput]:
    """Streams one prompt (chat messages, or text without a chat template) and measures it
    with `clock` (seconds)."""
    base = request_body(model, n, sampling, ignore_eos)

    def run(p: PreparedPrompt) -> RunOutput:
        if p.chat:
            path, body = "/chat/completions", {**base, "messages": p.messages}
        else:
            path, body = "/completions", {**base, "prompt": p.text}
        t0 = clock()
        first = last = None
        pieces: list[str] = []
        usage, finish = None, None
        for event in server.stream(path, body):
            now = clock()
            if isinstance(event.get("usage"), dict):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                piece, thought = _piece(choice, p.chat)
                if piece or thought:  # reasoning text is decoded too: it counts for time
                    first = now if first is None else first
                    last = now
                pieces.append(piece)
                finish = choice.get("finish_reason") or finish
        timing = (t0, first, last, clock())
        return _output(f"{server.base_url}{path}", usage, timing, "".join(pieces), finish)

    return run


def _piece(choice: Any, chat: bool) -> tuple[str, str]:
    """(content, reasoning text) of one streamed choice."""
    if not isinstance(choice, dict):
        return "", ""
    if not chat:
        return _text(choice.get("text")), ""
    delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
    thought = _text(delta.get("reasoning_content")) or _text(delta.get("reasoning"))
    return _text(delta.get("content")), thought


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _output(
    url: str,
    usage: dict[str, Any] | None,
    timing: tuple[float, float | None, float | None, float],
    text: str,
    finish: str | None,
) -> RunOutput:
    """The run's figures; `timing` is (request sent, first and last content chunk, end)."""
    t0, first, last, end = timing
    tokens = usage.get("completion_tokens") if usage else None
    if not is_int(tokens):
        raise ServerAnswerError(
            f"{url} sent no usage chunk with completion_tokens (it was asked with "
            "stream_options.include_usage): the tokens cannot be counted"
        )
    if first is None or last is None:
        raise ServerAnswerError(f"{url} streamed no content ({tokens} completion tokens)")
    span = last - first
    if tokens > 1 and span <= 0:
        raise ServerAnswerError(
            f"{url} sent all {tokens} tokens in one chunk: no decode time "
            "to measure (does the server stream?)"
        )
    return RunOutput(
        token_ids=[],
        new_tokens=tokens,
        decode_tokens_per_second=(tokens - 1) / span if tokens > 1 else 0.0,
        time_to_first_token=first - t0,
        wall_seconds=end - t0,
        finish_reason=finish,
        text=text,
    )


def build_openai_strategy(
    spec: StrategySpec, *, n: int, sampling: SamplingParams, ignore_eos: bool, chat: bool
) -> BenchStrategy:
    """A ready server baseline (its model resolved), or one carrying why it cannot run."""
    url, model = spec.options["url"], spec.options.get("model")
    description = {
        **spec.describe(),
        "url": url,
        "endpoint": "/chat/completions" if chat else "/completions",
        "ignore_eos_sent": ignore_eos,
    }
    try:
        server = OpenAIServer(url, os.environ.get("OPENAI_API_KEY") or None)
        description["model"] = model = model or server.first_model()
    except (ImportError, ServerAnswerError) as exc:
        return BenchStrategy(
            spec.label, "openai", None, description, error=f"cannot use the server: {exc}"
        )
    run = openai_runner(server, model, n, sampling, ignore_eos)
    return BenchStrategy(spec.label, "openai", run, description, takes_prompt=True)
