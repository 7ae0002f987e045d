"""OpenAI request bodies → specfork configs, and specfork results → OpenAI response bodies.

Parsing is done by hand (not by pydantic models) so that every mistake becomes one HTTP 400 in
OpenAI's error shape naming the offending field. The configs validate themselves
(`SamplingParams`, `GenerationConfig`, `SpecConfig`); their `ConfigError` messages are passed on
as they are.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from specfork.checks import is_int
from specfork.config import MAX_LOGPROBS, GenerationConfig, SamplingParams, SpecConfig
from specfork.constraint import Constraint
from specfork.engine.logprobs import TokenLogprob
from specfork.engine.stats import GenerationStats
from specfork.engine.tool_calls import (
    Tool,
    call_schema,
    call_text,
    response_text,
    with_tools,
)
from specfork.errors import ConfigError
from specfork.loading.chat_template import CHAT_ROLES
from specfork.spec_schema import (
    OPTIONS_BY_NAME,
    Wording,
    check_used,
    implied_strategy,
    spec_with,
)
from specfork.strategies.registry import draft_nodes_bound

Kind = Literal["completion", "chat"]
Prompt = str | list[int] | list[dict[str, str]]

ROLES = CHAT_ROLES
REQUEST_WORDING = Wording("key", lambda o: f"speculative.{o.name}", this="this request")
SPEC_KEYS = ("strategy", *OPTIONS_BY_NAME)  # one schema with the CLI flags and bench specs
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex")
MAX_STOP_STRINGS = 16
MAX_TOOLS = 128  # functions one request may list (OpenAI's limit)
MAX_CHOICES = 8  # n: completions one request may ask for (they decode in one batch)
MAX_STOP_CHARS = 512  # characters per stop string
MAX_SPEC_INT = 64  # largest k / n-gram size a request may ask for
LAYERS = re.compile(r"\s*\d{1,4}(\s*-\s*\d{1,4})?(\s*,\s*\d{1,4}(\s*-\s*\d{1,4})?)*\s*")
COMMON_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "user",
        "speculative",
        "ignore_eos",
        "exact",
        "logprobs",
        "response_format",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
    }
)
KIND_FIELDS = {
    "completion": {"prompt"},
    "chat": {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
}
# Accepted OpenAI fields whose features specfork lacks: allowed only at their neutral values.
NEUTRAL = {
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "store": (False,),
    "metadata": (),
    "service_tier": (),
}


MAX_ERROR_CHARS = 1000  # an error message quoting a huge value keeps its start and its end


def _bounded(message: str) -> str:
    """`message`, its middle elided when it is longer than MAX_ERROR_CHARS (a bad value quoted
    whole — megabytes of it — would make the answer as large as the request)."""
    if len(message) <= MAX_ERROR_CHARS:
        return message
    cut = len(message) - MAX_ERROR_CHARS + 30
    return f"{message[:700]} … ({cut} characters elided) … {message[700 + cut :]}"


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        retry_after: int = 1,
    ) -> None:
        message = _bounded(message)
        super().__init__(message)
        self.retry_after = retry_after  # seconds, sent as Retry-After with HTTP 429
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _error_type(status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_exceeded"
    if status >= 500:
        return "server_error"
    return "not_found_error" if status == 404 else "invalid_request_error"


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the server lets one request ask for (its operator's choices)."""

    max_draft_nodes: int = 256  # tokens a request's strategy may draft per round
    fixed_strategy: bool = False  # requests may not send a `speculative` object
    allow_lossy: bool = False  # requests may ask for Medusa's typical acceptance (lossy)
    max_seconds: float | None = 300.0  # decoding time of one request (finish reason "length")
    max_mask_ms: float | None = 25.0  # a constraint's mean masking time per token (None: any)


@dataclass(frozen=True, slots=True)
class ParseContext:
    """What request validation needs to know about the server."""

    model_name: str
    context: int  # tokens the model's context holds (prompt + completion)
    default_spec: SpecConfig
    default_max_tokens: int = 256
    limits: RequestLimits = RequestLimits()


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One validated request, ready for the engine."""

    kind: Kind
    prompt: Prompt
    config: GenerationConfig
    sampling: SamplingParams
    spec: SpecConfig | None  # None: the server's strategy
    stream: bool
    include_usage: bool
    max_tokens_given: bool
    n: int = 1  # choices: independent completions of the prompt, decoded together
    tools: tuple[Tool, ...] = ()  # functions the model may call (chat)
    tool_mode: str = "none"  # "none", "auto" (the output may call) or "required" (it calls)

    def choice_sampling(self, index: int) -> SamplingParams:
        """Choice `index`'s sampling: a seeded request's choices draw from seed, seed + 1, …
        (distinct completions, each reproducible)."""
        seed = self.sampling.seed
        if seed is None or index == 0:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=(seed + index) % 2**63)


def parse_request(body: bytes, kind: Kind, ctx: ParseContext) -> CompletionRequest:
    """Validate a JSON body; raises APIError (HTTP 400) naming the offending field."""
    obj = _load_object(body)
    _check_fields(obj, kind)
    _check_model(obj.get("model"), ctx.model_name)
    prompt = _prompt(obj) if kind == "completion" else _messages(obj.get("messages"))
    max_tokens = _max_tokens(obj, ctx.context)
    stream = _bool(obj, "stream")
    n = _choices(obj.get("n"), stream)
    limits = ctx.limits
    config = _generation(obj, kind, max_tokens or ctx.default_max_tokens, limits)
    tools = _tools(obj.get("tools")) if kind == "chat" else ()
    mode, callable_tools = _tool_choice(obj.get("tool_choice"), tools)
    if mode != "none":
        _check_with_tools(config, stream)
        prompt = with_tools(prompt, tools)  # type: ignore[arg-type]
    if mode == "required":
        call = Constraint.json_schema(call_schema(callable_tools))
        config = dataclasses.replace(config, constraint=call, max_mask_ms=limits.max_mask_ms)
    return CompletionRequest(
        kind=kind,
        prompt=prompt,
        config=config,
        sampling=_sampling(obj),
        spec=_speculative(obj.get("speculative"), ctx.default_spec, limits),
        stream=stream,
        include_usage=_include_usage(obj.get("stream_options"), stream),
        max_tokens_given=max_tokens is not None,
        n=n,
        tools=tools,
        tool_mode=mode,
    )


def _tools(value: Any) -> tuple[Tool, ...]:
    """OpenAI's `tools`: function definitions (an empty list: none)."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise APIError(f"tools must be a list of at most {MAX_TOOLS} functions", param="tools")
    tools = []
    for i, item in enumerate(value):
        param = f"tools[{i}]"
        function = item.get("function") if isinstance(item, dict) else None
        if (
            not isinstance(item, dict)
            or item.get("type") != "function"
            or not isinstance(function, dict)
        ):
            raise APIError(
                f'{param} must be {{"type": "function", "function": {{"name": ..., '
                '"parameters": {...}}}',
                param=param,
            )
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        try:
            tools.append(Tool(function.get("name"), function.get("description") or "", parameters))
        except ConfigError as exc:
            raise APIError(str(exc), param=f"{param}.function") from None
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError("tools names a function twice", param="tools")
    return tuple(tools)


def _tool_choice(value: Any, tools: tuple[Tool, ...]) -> tuple[str, tuple[Tool, ...]]:
    """OpenAI's `tool_choice`: "none", "auto" (the default with tools), "required" or a named
    function; the mode and the tools a required call may be of."""
    if value is None:
        return ("auto" if tools else "none"), tools
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise APIError(f"tool_choice {value!r} needs tools", param="tool_choice")
        return value, tools
    named = value.get("function") if isinstance(value, dict) else None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(named, dict):
        chosen = tuple(t for t in tools if t.name == named.get("name"))
        if not chosen:
            raise APIError(
                f"tool_choice names the function {named.get('name')!r}, which tools does not list",
                param="tool_choice",
            )
        return "required", chosen
    raise APIError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
        '{"name": ...}}',
        param="tool_choice",
    )


def _check_with_tools(config: GenerationConfig, stream: bool) -> None:
    if stream:
        raise APIError(
            "with tools the answer is sent whole, not streamed (its calls are read from the "
            'complete output); send stream false or tool_choice "none"',
            param="stream",
            code="unsupported_parameter",
        )
    if config.constraint is not None:
        raise APIError(
            "response_format and tools together are not supported; give one of them",
            param="response_format",
        )


def _load_object(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        reason = "an integer has over 4,300 digits" if "int_max_str_digits" in str(exc) else exc
        message = f"the request body is not valid JSON ({reason})"
        raise APIError(message, code="invalid_json") from exc
    if not isinstance(obj, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    _check_unicode(obj)
    return {k: v for k, v in obj.items() if v is not None}  # null means "not given"


def _check_unicode(value: Any) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate such as \\ud800, which JSON
    escapes can spell): no tokenizer or response could carry it."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise APIError(
                    "the request holds text that is not valid Unicode (a lone surrogate escape "
                    f"such as \\ud800 at position {exc.start} of a string); send UTF-8 text",
                    code="invalid_json",
                ) from None


def _check_fields(obj: dict[str, Any], kind: Kind) -> None:
    known = COMMON_FIELDS | KIND_FIELDS[kind]
    for name, value in obj.items():
        if name in known:
            continue
        if name not in NEUTRAL:
            raise APIError(
                f"unrecognized request argument {name!r}", param=name, code="unknown_parameter"
            )
        allowed = NEUTRAL[name]
        if allowed and value not in allowed:
            raise APIError(
                f"{name} is not supported by this server; leave it out or give {allowed[0]!r}",
                param=name,
                code="unsupported_parameter",
            )


def _check_model(model: Any, served: str) -> None:
    if model is not None and model != served:
        raise APIError(
            f"the model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def _choices(n: Any, stream: bool) -> int:
    """`n`: how many choices (1 when not given)."""
    if n is None:
        return 1
    if not is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise APIError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", param="n")
    if n > 1 and stream:
        raise APIError(
            "n > 1 is answered whole, not streamed; send stream false, or n 1 per stream",
            param="n",
            code="unsupported_parameter",
        )
    return n


def _prompt(obj: dict[str, Any]) -> str | list[int]:
    prompt, where = obj.get("prompt"), "prompt"
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt, where = prompt[0], "prompt[0]"  # a batch of one
    if isinstance(prompt, str):
        if not prompt.strip():
            raise APIError("the prompt is empty; give some text to continue", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return list(prompt)
    several = isinstance(prompt, list) and len(prompt) > 1
    if several and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError("one prompt per request; send the prompts separately", param="prompt")
    if isinstance(prompt, list) and prompt:
        index, bad = next((i, t) for i, t in enumerate(prompt) if not _is_token_id(t))
        shown = json.dumps(bad)
        shown = shown if len(shown) <= 40 else shown[:40] + "…"
        raise APIError(
            f"{where}[{index}] is {shown}: a prompt list holds token ids, integers >= 0 (or "
            "give one string)",
            param="prompt",
        )
    raise APIError("prompt is required: a non-empty string or a list of token ids", param="prompt")


def _is_token_id(t: Any) -> bool:
    return is_int(t) and t >= 0


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise APIError("messages is required: a non-empty list of messages", param="messages")
    parsed = [_message(m, i) for i, m in enumerate(messages)]
    if not any(m["content"].strip() for m in parsed):
        raise APIError("every message is empty; give some text", param="messages")
    return parsed


def _message(m: Any, i: int) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise APIError(f"{param} must be an object with role and content", param=param)
    role = m.get("role")
    if role == "tool":  # a call's result: the next user turn carries it
        return {"role": "user", "content": response_text(_content(m.get("content"), param))}
    if role == "assistant" and m.get("tool_calls"):
        return {"role": "assistant", "content": _with_calls(m, param)}
    if not isinstance(role, str) or role not in ROLES:
        raise APIError(
            f"{param}.role {role!r} is not supported; use one of {', '.join(ROLES)}",
            param=f"{param}.role",
        )
    return {"role": ROLES[role], "content": _content(m.get("content"), f"{param}.content")}


def _with_calls(m: dict[str, Any], param: str) -> str:
    """An assistant turn that called tools, as it wrote the calls (`tool_calls.call_text`)."""
    calls = m["tool_calls"]
    text = "" if m.get("content") is None else _content(m.get("content"), f"{param}.content")
    if not isinstance(calls, list):
        raise APIError(f"{param}.tool_calls must be a list of calls", param=f"{param}.tool_calls")
    parts = [text] if text else []
    for j, call in enumerate(calls):
        where = f"{param}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise APIError(
                f'{where} must be {{"function": {{"name": ..., "arguments": ...}}}}', param=where
            )
        try:
            parts.append(call_text(name, function.get("arguments") or {}))
        except ConfigError as exc:
            raise APIError(str(exc), param=where) from None
    return "\n".join(parts)


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise APIError(f"{param} must be a string or a list of text parts", param=param)


def _max_tokens(obj: dict[str, Any], context: int) -> int | None:
    """The output budget; chat's `max_completion_tokens` wins over `max_tokens` (both checked)."""
    chosen = None
    for name in ("max_tokens", "max_completion_tokens"):
        n = obj.get(name)
        if n is None:
            continue
        if not is_int(n) or n < 1:
            raise APIError(f"{name} must be an integer >= 1, got {n!r}", param=name)
        if n >= context:
            raise APIError(
                f"{name}={n} is beyond the context of {context} tokens (prompt included)",
                param=name,
                code="context_length_exceeded",
            )
        chosen = n
    return chosen


def _bool(obj: dict[str, Any], name: str) -> bool:
    value = obj.get(name, False)
    if not isinstance(value, bool):
        raise APIError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:  # as OpenAI answers
        raise APIError(
            'stream_options is only allowed with "stream": true; leave it out or stream',
            param="stream_options",
        )
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise APIError('stream_options must be {"include_usage": bool}', param="stream_options")
    return options.get("include_usage", False)


def _generation(
    obj: dict[str, Any], kind: Kind, max_tokens: int, limits: RequestLimits
) -> GenerationConfig:
    stop = obj.get("stop")
    if stop is None:  # absent, or null as OpenAI allows
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS:
        raise APIError(
            f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", param="stop"
        )
    if any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(f"stop strings must be at most {MAX_STOP_CHARS} characters", param="stop")
    logprobs = _logprobs(obj, kind)
    ignore_eos, exact = _bool(obj, "ignore_eos"), _bool(obj, "exact")
    constraint = response_format(obj.get("response_format"))
    try:
        return GenerationConfig(
            max_new_tokens=max_tokens,
            stop=tuple(stop),
            ignore_eos=ignore_eos,
            exact=exact,
            max_seconds=limits.max_seconds,
            logprobs=logprobs,
            constraint=constraint,
            max_mask_ms=limits.max_mask_ms if constraint is not None else None,
        )
    except ConfigError as exc:
        raise APIError(str(exc), param="stop") from exc


def response_format(value: Any) -> Constraint | None:
    """OpenAI's `response_format`: {"type": "text"} (none), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
    specfork also takes {"type": "regex", "regex": PATTERN}."""
    param = "response_format"
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise APIError(
            f'{param} must be an object with "type" one of {", ".join(RESPONSE_FORMATS)}, '
            f"got {value!r:.200}",
            param=param,
        )
    try:
        if kind == "json_object":
            return Constraint.json_object()
        if kind == "regex":
            return Constraint.regex(value.get("regex"))
        if kind == "json_schema":
            return Constraint.json_schema(_schema(value.get("json_schema")))
    except ConfigError as exc:
        raise APIError(str(exc), param=param, code="invalid_response_format") from exc
    return None  # "text"


def _schema(spec: Any) -> dict[str, Any]:
    """The schema of a json_schema response format (name required as OpenAI does)."""
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise APIError(f'{param} must be an object with "name" and "schema"', param=param)
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise APIError(
            f"{param}.name must be 1-64 letters, digits, underscores or dashes, got {name!r}",
            param=f"{param}.name",
        )
    strict = spec.get("strict", False)
    if strict is not None and not isinstance(strict, bool):
        raise APIError(f"{param}.strict must be true or false", param=f"{param}.strict")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise APIError(f"{param}.schema must be a JSON schema object", param=f"{param}.schema")
    return schema


def _logprobs(obj: dict[str, Any], kind: Kind) -> int | None:
    """How many alternatives per token to report (None: no log-probabilities). Completions
    take `logprobs: n`; chat takes `logprobs: true` with `top_logprobs: n`."""
    if kind == "completion":
        n = obj.get("logprobs", False)
        if n is False:
            return None
        if not is_int(n) or not 0 <= n <= MAX_LOGPROBS:
            raise APIError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token), "
                f"got {n!r}",
                param="logprobs",
            )
        return n
    wanted = _bool(obj, "logprobs")
    top = obj.get("top_logprobs", 0)
    if not is_int(top) or not 0 <= top <= MAX_LOGPROBS:
        raise APIError(
            f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}",
            param="top_logprobs",
        )
    if top and not wanted:
        raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    return top if wanted else None


def _sampling(obj: dict[str, Any]) -> SamplingParams:
    names = ("temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty")
    names += ("frequency_penalty",)
    given = {n: obj[n] for n in names if obj.get(n) is not None}
    given.setdefault("temperature", 1.0)  # OpenAI's default; 0 is greedy
    if obj.get("logit_bias") is not None:
        given["logit_bias"] = _logit_bias(obj["logit_bias"])
    try:
        return SamplingParams(**given)
    except ConfigError as exc:
        field = str(exc).split(" ", 1)[0]
        raise APIError(str(exc), param=field if field in (*names, "logit_bias") else None) from exc


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: an object of token ids (as strings) to biases in [-100, 100]."""
    if not isinstance(value, dict):
        raise APIError(
            'logit_bias must be an object of token ids to biases, e.g. {"42": -100}',
            param="logit_bias",
        )
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 9):
            raise APIError(
                f"logit_bias keys are token ids written as strings, got {key!r}",
                param="logit_bias",
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise APIError(
                f"logit_bias[{key!r}] must be a number, got {bias!r}", param="logit_bias"
            )
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _speculative(obj: Any, default: SpecConfig, limits: RequestLimits) -> SpecConfig | None:
    """The request's strategy: the server's, with the keys of `obj` replaced."""
    if obj is None:
        return None
    if limits.fixed_strategy:
        raise APIError(
            "this server runs one strategy for every request (it was started with "
            "--fixed-strategy); leave out speculative",
            param="speculative",
            code="unsupported_parameter",
        )
    if not isinstance(obj, dict):
        raise APIError("speculative must be an object of strategy settings", param="speculative")
    unknown = sorted(set(obj) - set(SPEC_KEYS))
    if unknown:
        raise APIError(
            f"unknown key(s) in speculative: {', '.join(unknown)}; "
            f"valid keys: {', '.join(SPEC_KEYS)}",
            param="speculative",
        )
    obj = {key: value for key, value in obj.items() if value is not None}  # null: not given
    _check_spec_values(obj, default)
    try:
        if "strategy" not in obj and not default.drafts:  # as the CLI: options imply one
            implied = implied_strategy(list(obj), REQUEST_WORDING)
            obj = obj if implied is None else {"strategy": implied, **obj}
        spec = spec_with(default, obj)
        _check_drafter_paths(spec, default)
        check_used(spec.strategy, [key for key in obj if key != "strategy"], REQUEST_WORDING)
    except ConfigError as exc:
        raise APIError(str(exc), param="speculative") from exc
    _check_limits(spec, default, limits)
    return spec if spec.drafts else SpecConfig()


def _check_limits(spec: SpecConfig, default: SpecConfig, limits: RequestLimits) -> None:
    """The server's bounds on a request's strategy: drafted tokens per round (jointly, e.g.
    forks × depth), and lossy verification only where the server allows it (the server's own
    strategy is always allowed)."""
    nodes, how = draft_nodes_bound(spec)
    allowed = max(limits.max_draft_nodes, draft_nodes_bound(default)[0])
    if nodes > allowed:
        raise APIError(
            f"speculative asks for up to {nodes} drafted tokens per round ({how}); this server "
            f"allows {allowed} (--max-draft-nodes): ask for fewer",
            param="speculative",
        )
    if spec.lossy_typical and not (limits.allow_lossy or default.lossy_typical):
        raise APIError(
            "speculative.lossy_typical changes the output (Medusa's typical acceptance is not "
            "lossless) and this server keeps every request lossless; start it with "
            "--allow-lossy to let requests opt in",
            param="speculative.lossy_typical",
        )


def _check_spec_values(obj: dict[str, Any], default: SpecConfig) -> None:
    """What a remote client may not ask for: the recycle prior's one-off computation, huge
    layer lists or drafts (new draft models: `_check_drafter_paths`)."""
    if obj.get("recycle_prior") is True and not default.recycle_prior:
        raise APIError(
            "a request cannot turn on the recycle prior (computed once per model, ~25 s, while "
            "every other request waits); start the server with --recycle-prior",
            param="speculative.recycle_prior",
        )
    for name in ("self_layers", "skip_layers"):
        value = obj.get(name)
        if value is not None and not (isinstance(value, str) and LAYERS.fullmatch(value)):
            raise APIError(
                f'speculative.{name} must be a layer list such as "0-11" or "0,2,4-7"',
                param=f"speculative.{name}",
            )
    for name in ("k", "max_ngram", "min_ngram", "min_k", "max_k", "forks", "depth", "budget"):
        value = obj.get(name)
        if isinstance(value, int) and value > MAX_SPEC_INT:
            raise APIError(
                f"speculative.{name} must be at most {MAX_SPEC_INT}, got {value}",
                param=f"speculative.{name}",
            )


def _check_drafter_paths(spec: SpecConfig, default: SpecConfig) -> None:
    """A request's drafter loads nothing from a path the server was not started with."""
    allowed = set(default.sources)
    if any(s.path is not None and s not in allowed for s in spec.sources):
        raise APIError(
            "a request cannot load a draft model or head from a path; use drafter ngram, self "
            "or head, or start the server with --drafter model:PATH / head:PATH",
            param="speculative.drafter",
        )


# -- responses ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """The fields every response and chunk of one request share."""

    kind: Kind
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, kind: Kind, model: str) -> ResponseMeta:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def head(self, chunk: bool) -> dict[str, Any]:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        if chunk and self.kind == "chat":
            obj += ".chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(reason: str) -> str:
    """OpenAI's finish reason: a request stopped by the server's time limit ("time") reports
    "length", like any other limit (`speculative.time_limit_reached` says which)."""
    return "length" if reason == "time" else reason


def speculative_stats(
    spec: SpecConfig, stats: GenerationStats, plain_under_load: bool, reason: str = ""
) -> dict:
    """The request's decoding figures (the `speculative` object of a response)."""
    speculating = spec.drafts
    return {
        "strategy": spec.strategy,
        "drafter": spec.drafter if speculating else None,
        "k": spec.k if speculating else 0,
        "lossless": not spec.lossy_typical,
        "plain_under_load": plain_under_load,
        "time_limit_reached": reason == "time",
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "target_forwards": stats.target_forwards,
        "draft_forwards": stats.draft_forwards,
        "time_to_first_token": stats.time_to_first_token,
        "decode_tokens_per_second": _finite(stats.decode_tokens_per_second),
    }


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def choice(
    kind: Kind,
    text: str,
    finish_reason: str | None,
    chunk: bool,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One element of `choices`: a whole answer, or a streamed delta when `chunk`."""
    out: dict[str, Any] = {"index": index}
    if kind == "completion":
        out.update(text=text, logprobs=logprobs)
    elif chunk:
        out.update(delta={"content": text} if text else {}, logprobs=logprobs)
    else:
        out.update(message={"role": "assistant", "content": text}, logprobs=logprobs)
    out["finish_reason"] = finish_reason
    return out


def logprobs_body(
    kind: Kind, entries: list[TokenLogprob], text_of: Callable[[int], str], offset: int = 0
) -> dict[str, Any]:
    """OpenAI's `logprobs` object for `entries`: chat's {"content": [{token, logprob, bytes,
    top_logprobs}]}, or completions' parallel lists (`offset`: characters of text before the
    first entry, for `text_offset`). Values are the raw log-softmax of the target's logits.
    An emitted token is named by its piece of the output (decoded in context, so the pieces
    join to the text); an alternative by its own decoding (`text_of`)."""
    if kind == "chat":
        return {"content": [_chat_entry(e, text_of) for e in entries], "refusal": None}
    tokens = [e.text for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{text_of(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def _chat_entry(entry: TokenLogprob, text_of: Callable[[int], str]) -> dict[str, Any]:
    def one(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    top = [one(text_of(t), lp) for t, lp in entry.top]
    return {**one(entry.text, entry.logprob), "top_logprobs": top}
