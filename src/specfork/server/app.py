"""The FastAPI app: OpenAI-compatible completions and chat, models, health and metrics.

Handlers validate a request (`schemas`), tokenize it off the event loop, queue it for the one
engine worker (`worker`), then answer with the whole completion or stream it as server-sent
events in OpenAI's chunk format. Every error is answered in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specfork.engine.tool_calls import parse_calls
from specfork.errors import SpecforkError
from specfork.server import schemas
from specfork.server.metrics import CONTENT_TYPE, ServerMetrics
from specfork.server.schemas import APIError, CompletionRequest, Kind, ResponseMeta
from specfork.server.security import Guard
from specfork.server.worker import Engine, EngineWorker, Event, Job, ServerSettings

log = logging.getLogger(__name__)

DISCONNECT_POLL_SECONDS = 0.5
ENDPOINTS: dict[Kind, str] = {"completion": "completions", "chat": "chat.completions"}


def _endpoint(path: str) -> str:
    """The endpoint label of a request path (refusals before routing): a generation endpoint's
    own label, else "other" (a label per path would let clients grow the metric without end)."""
    return {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions"}.get(
        path, "other"
    )


def create_app(
    generator: Engine,
    *,
    model_name: str,
    queue_size: int = 64,
    plain_above_queue: int | None = None,
    thread: Executor | None = None,
    **settings: Any,
) -> FastAPI:
    """An app serving `generator` (a `specfork.engine.Generator`) under `model_name`.

    `thread` is the single-thread executor (`specfork.engine.thread.model_thread()`) that loaded
    the generator's model: requests run there, at full speed. `settings` are the other
    `ServerSettings` fields (retry_after, default_max_tokens, max_body_bytes, api_key,
    allowed_hosts, max_draft_nodes, request_timeout, fixed_strategy, allow_lossy,
    metrics_prefix, max_running). The engine worker runs between startup and shutdown.
    """
    config = ServerSettings(
        model_name, queue_size=queue_size, plain_above_queue=plain_above_queue, **settings
    )
    metrics = ServerMetrics(config.metrics_prefix, model_name)
    worker = EngineWorker(generator, metrics, config, thread)
    handlers = _Handlers(generator, worker, metrics, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await run_in_threadpool(worker.stop)

    app = FastAPI(  # no /docs, /redoc, /openapi.json: nothing is served that the guard skips
        title="specfork",
        version=_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(
        Guard,
        api_key=config.api_key,
        allowed_hosts=config.allowed_hosts,
        on_refusal=lambda path, status: metrics.count_request(_endpoint(path), status),
    )
    app.state.worker, app.state.metrics = worker, metrics
    _add_error_handlers(app)
    app.add_api_route("/v1/completions", handlers.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", handlers.chat, methods=["POST"])
    app.add_api_route("/v1/models", handlers.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", handlers.model, methods=["GET"])
    app.add_api_route("/health", handlers.health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", handlers.metrics, methods=["GET"])
    return app


def _version() -> str:
    from specfork import __version__

    return __version__


def error_response(exc: APIError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if exc.status == 429 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def validation(_: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(f"invalid request: {exc}"))

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(APIError(str(exc.detail), status=exc.status_code))

    async def internal(_: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error while handling a request", exc_info=exc)
        return error_response(APIError("internal server error", status=500))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal)


LARGE_BODY = 256 * 1024  # bytes: a request body this large is tokenized after the others


class _Handlers:
    """The routes, bound to one engine worker."""

    def __init__(
        self, engine: Engine, worker: EngineWorker, metrics: ServerMetrics, config: ServerSettings
    ) -> None:
        self.engine = engine
        self.worker = worker
        self.metrics_ = metrics
        self.config = config
        self.ctx = schemas.ParseContext(
            config.model_name,
            engine.context,
            engine.default_spec,
            config.default_max_tokens,
            config.limits,
        )
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}
        # bodies this large are tokenized one at a time: however many arrive together (a
        # prompt about to be refused as too long included), they take one core from decoding
        self._large_prompts = asyncio.Semaphore(1)

    # -- simple routes --------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        if model_id != self.config.model_name:
            raise APIError(
                f"the model {model_id!r} does not exist",
                status=404,
                param="model",
                code="model_not_found",
            )
        return self._model_card()

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "specfork",
            "max_model_len": self.engine.context,
        }

    async def health(self) -> JSONResponse:
        ok = self.worker.alive
        body = {
            "status": "ok" if ok else "unavailable",
            "model": self.config.model_name,
            "queue_depth": self.worker.depth,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self) -> Response:
        return Response(self.metrics_.render(), media_type=CONTENT_TYPE)

    # -- completions ----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def _complete(self, request: Request, kind: Kind) -> Response:
        endpoint = ENDPOINTS[kind]
        try:
            body = await self._body(request)
            req = schemas.parse_request(body, kind, self.ctx)
            ids = await self._encode_in_turn(req, large=len(body) > LARGE_BODY)
            jobs = self._submit(req, ids)
            firsts = [await self._first(job, req, request) for job in jobs]
        except APIError as exc:
            self.metrics_.count_request(endpoint, exc.status)
            return error_response(exc)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            jobs, firsts = [], [None]
        failed = next((e for e in firsts if e is None or e.kind == "error"), False)
        if failed is not False:
            for job in jobs:
                job.cancel()
        if failed is None:  # the client went away
            self.metrics_.count_request(endpoint, 499)
            return Response(status_code=499)
        if failed:
            assert failed.error is not None
            self.metrics_.count_request(endpoint, failed.error.status)
            return error_response(failed.error)
        meta = ResponseMeta.new(kind, self.config.model_name)
        if req.stream:
            count = functools.partial(self.metrics_.count_request, endpoint)
            return _EventStream(jobs[0], req, meta, count, self._token_text)
        self.metrics_.count_request(endpoint, 200)
        done = [event for event in firsts if event is not None]
        return JSONResponse(_whole_body(meta, done, self._token_text, req))

    def _submit(self, req: CompletionRequest, ids: list[int]) -> list[Job]:
        """One job per choice, queued together (none stays queued if one cannot be)."""
        jobs: list[Job] = []
        try:
            for index in range(req.n):
                job = Job(
                    ids,
                    req.config,
                    req.choice_sampling(index),
                    req.spec,
                    deltas=req.stream,
                    prompt_param="prompt" if req.kind == "completion" else "messages",
                )
                self.worker.submit(job)
                jobs.append(job)
        except APIError:
            for job in jobs:
                job.cancel()
            raise
        return jobs

    async def _first(self, job: Job, req: CompletionRequest, request: Request) -> Event | None:
        """A stream's first event (it has started), or a whole answer's result."""
        event = await self._wait(job, request)
        if event is not None and event.kind == "start" and not req.stream:
            event = await self._wait(job, request)
        return event

    def _token_text(self, token_id: int) -> str:
        """A token's own text, as log-probabilities name alternatives (cached: a response
        may name thousands)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    async def _body(self, request: Request) -> bytes:
        """The body, refused (413) as soon as its declared or received size is over the cap."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise APIError(f"the request body is over {limit} bytes", status=413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(f"the request body is over {limit} bytes", status=413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _encode_in_turn(self, req: CompletionRequest, large: bool) -> list[int]:
        """`_encode` in a thread-pool thread; a large body waits (without a thread) for the
        large ones before it."""
        if not large:
            return await run_in_threadpool(self._encode, req)
        async with self._large_prompts:
            return await run_in_threadpool(self._encode, req)

    def _encode(self, req: CompletionRequest) -> list[int]:
        """Prompt token ids, checked against the context (runs in a thread-pool thread)."""
        param = "prompt" if req.kind == "completion" else "messages"
        prompt = req.prompt
        try:
            if isinstance(prompt, list) and isinstance(prompt[0], int):
                ids = list(prompt)  # type: ignore[arg-type]
            else:
                ids = self.engine.encode_prompt(prompt, chat=req.kind == "chat")
        except SpecforkError as exc:
            raise APIError(str(exc), param=param) from exc
        context = self.engine.context
        if len(ids) >= context:
            raise APIError(
                f"the prompt has {len(ids)} tokens but the context holds {context}; shorten it",
                param=param,
                code="context_length_exceeded",
            )
        wanted = req.config.max_new_tokens
        if req.max_tokens_given and len(ids) + wanted > context:
            raise APIError(
                f"the context holds {context} tokens; the prompt has {len(ids)} and "
                f"max_tokens asks for {wanted} more",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return ids

    @staticmethod
    async def _wait(job: Job, request: Request) -> Event | None:
        """The job's next event; None (and the job cancelled) if the client disconnects."""
        while True:
            try:
                return await asyncio.wait_for(job.next_event(), DISCONNECT_POLL_SECONDS)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return None


class _EventStream(StreamingResponse):
    """Server-sent events of one job; however the stream ends (finished, failed, client gone,
    never started), the job is cancelled and the request counted with its final status."""

    def __init__(
        self,
        job: Job,
        req: CompletionRequest,
        meta: ResponseMeta,
        count: Callable[[int], None],
        token_text: Callable[[int], str],
    ) -> None:
        self.job, self.req, self.meta, self.count = job, req, meta, count
        self.token_text = token_text
        self.logprobs_sent = 0  # entries already streamed; the final chunk carries the rest
        self.chars_sent = 0  # token text so far (completions' text_offset)
        self.final_status = 499  # until the stream ends normally: the client went away
        super().__init__(
            self._events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()  # stops the generation at its next round (no-op once it is done)
            self.count(self.final_status)

    async def _events(self) -> AsyncIterator[str]:
        """Role (chat), text deltas, the finish chunk, usage, [DONE]."""
        kind, head = self.req.kind, self.meta.head(True)
        if kind == "chat":
            delta = {"role": "assistant", "content": ""}
            first = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            yield _data({**head, "choices": [first]})
        while True:
            event = await self.job.next_event()
            if event.kind == "delta":
                logprobs = self._logprobs(event.logprobs)
                choice = schemas.choice(kind, event.text, None, True, logprobs)
                yield _data({**head, "choices": [choice]})
            elif event.kind == "error":
                assert event.error is not None
                yield _data(event.error.body())
                yield "data: [DONE]\n\n"
                self.final_status = event.error.status
                return
            elif event.kind == "done":
                assert event.result is not None
                rest = event.result.logprobs
                logprobs = self._logprobs(rest[self.logprobs_sent :] if rest is not None else None)
                for chunk in _final_chunks(self.meta, event, self.req.include_usage, logprobs):
                    yield _data(chunk)
                yield "data: [DONE]\n\n"
                self.final_status = 200
                return

    def _logprobs(self, entries: list | None) -> dict[str, Any] | None:
        """The `logprobs` object of a chunk carrying `entries` (None: not asked for)."""
        if entries is None:
            return None
        body = schemas.logprobs_body(self.req.kind, entries, self.token_text, self.chars_sent)
        self.logprobs_sent += len(entries)
        self.chars_sent += sum(len(t) for t in body.get("tokens", ()))
        return body


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _whole_body(
    meta: ResponseMeta,
    done: list[Event],
    token_text: Callable[[int], str],
    req: CompletionRequest,
) -> dict[str, Any]:
    """The response to a request that is not streamed: its choices (n ≥ 1; the tool calls
    read from each output when the request has tools), usage (the prompt once, every choice's
    tokens) and the first choice's speculative stats (with n > 1, each choice's own too)."""
    choices, stats = [], []
    for index, event in enumerate(done):
        result = event.result
        assert result is not None and event.spec is not None
        logprobs = None
        if result.logprobs is not None:
            logprobs = schemas.logprobs_body(meta.kind, result.logprobs, token_text)
        reason = schemas.finish_reason(result.finish_reason)
        choice = schemas.choice(meta.kind, result.text, reason, False, logprobs, index)
        if req.tool_mode != "none":
            _read_calls(choice, result.text, req)
        stats.append(
            schemas.speculative_stats(
                event.spec, result.stats, event.plain_under_load, result.finish_reason
            )
        )
        if len(done) > 1:
            choice["speculative"] = stats[-1]
        choices.append(choice)
    results = [e.result for e in done if e.result is not None]
    completion = sum(len(r.token_ids) for r in results)
    return {
        **meta.head(False),
        "choices": choices,
        "usage": schemas.usage(len(results[0].prompt_ids), completion),
        "speculative": stats[0],
    }


def _read_calls(choice: dict[str, Any], text: str, req: CompletionRequest) -> None:
    """A chat choice whose output calls tools: the calls as `tool_calls`, the rest as content,
    finish reason "tool_calls"."""
    content, calls = parse_calls(text, req.tools)
    if not calls:
        return
    calls_json = [call.to_openai() for call in calls]
    choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls_json}
    choice["finish_reason"] = "tool_calls"


def _final_chunks(
    meta: ResponseMeta, done: Event, include_usage: bool, logprobs: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The chunk with the finish reason (the log-probabilities of tokens whose text was held
    back, and the request's speculative stats), then usage."""
    result = done.result
    assert result is not None and done.spec is not None
    reason = schemas.finish_reason(result.finish_reason)
    stats = schemas.speculative_stats(
        done.spec, result.stats, done.plain_under_load, result.finish_reason
    )
    last = {
        **meta.head(True),
        "choices": [schemas.choice(meta.kind, "", reason, True, logprobs)],
        "speculative": stats,
    }
    if not include_usage:
        return [last]
    tokens = schemas.usage(len(result.prompt_ids), len(result.token_ids))
    return [last, {**meta.head(True), "choices": [], "usage": tokens}]
