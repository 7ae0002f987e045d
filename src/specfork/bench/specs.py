"""Strategy specs of `specfork bench`: one short string per decoding method to compare.

Syntax::

    strategy[:drafter][?key=value&key=value]

- ``strategy`` is ``ar`` (plain decoding) or any specfork strategy (``speculative``,
  ``dspark``, ``spork`` and later ones as they are added to `specfork.catalog.kinds`), or
  ``hf`` for a Hugging Face transformers baseline.
- ``drafter`` is everything between the first ``:`` and ``?``: ``ngram``, ``self``,
  ``model:PATH-or-name``, or a strategy's own drafter names (``recycle+ngram``). It becomes
  the ``drafter`` field of :class:`specfork.config.SpecConfig`.
- ``key=value`` options set the :class:`~specfork.config.SpecConfig` field of that name
  (``-`` may stand for ``_``), converted as `specfork.spec_schema` says (the schema the CLI
  flags and the server's ``speculative`` objects use): integers, floats, strings, ``none``
  for optional fields, ``true``/``false`` for flags, and comma lists (``weights=0.4,0.3,0.3``).
  An option the strategy does not read (``dspark:ngram?forks=2``) is an error.
- ``hf:ar`` is transformers' ``generate``; ``hf:prompt-lookup`` its prompt lookup decoding
  (options ``k`` = ``prompt_lookup_num_tokens``, default 10, and ``max_ngram`` =
  ``max_matching_ngram_size``); ``hf:assisted`` assisted generation with a draft model
  (options ``draft`` = a packaged model name or path, default the first ``model:`` drafter of
  the run or else the target itself, ``k`` = ``num_assistant_tokens`` and ``schedule`` =
  ``num_assistant_tokens_schedule``).
- ``openai:URL[#model]`` is any OpenAI-compatible server (vLLM, SGLang, llama-server,
  ``specfork serve``) at its API base URL, e.g. ``openai:http://127.0.0.1:8000/v1#Qwen/Qwen3-0.6B``;
  without ``#model`` the server's first listed model (`specfork.bench.openai_api`). No options.
- ``llamacpp:ar`` is llama.cpp's plain decoding of the same GGUF (through llama-cpp-python),
  ``llamacpp:lookup`` its prompt lookup decoding (options ``k``, tokens drafted per step, default
  4, and ``max_ngram``, default 2).

Examples: ``ar``, ``speculative:ngram?k=4&k_policy=heuristic``, ``speculative:self?skip_layers=
10-19&k=3``, ``spork:recycle+ngram?forks=4&depth=6``, ``hf:prompt-lookup?k=10``. A list is
comma-separated; a comma inside an option value (a tuple) is kept with its option. Each spec's
display label is the spec string itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specfork.catalog.kinds import STRATEGY_NAMES, strategy_kind
from specfork.config import SpecConfig
from specfork.errors import ConfigError
from specfork.spec_schema import OPTIONS_BY_NAME, check_used, option

HF_METHODS: dict[str, dict[str, type]] = {
    "ar": {},
    "prompt-lookup": {"k": int, "max_ngram": int},
    "assisted": {"draft": str, "k": int, "schedule": str},
}
LLAMACPP_METHODS: dict[str, dict[str, type]] = {
    "ar": {},
    "lookup": {"k": int, "max_ngram": int},
}
BASELINES = {"hf": ("transformers", HF_METHODS), "llamacpp": ("llama.cpp", LLAMACPP_METHODS)}
SERVER = "openai"  # openai:URL[#model]: an OpenAI-compatible server
HF_SCHEDULES = ("constant", "heuristic", "heuristic_transient")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_POSITIONAL = ("strategy", "drafter")  # given by the spec's prefix, not as options


@dataclass(frozen=True)
class StrategySpec:
    """One parsed strategy spec.

    ``family`` is "specfork" (``spec`` is the SpecConfig to run), "hf" or "llamacpp" (``method``
    is one of that baseline's methods and ``options`` its converted options), or "openai"
    (``options`` holds the server's ``url`` and the ``model``, None for its first).
    """

    label: str
    family: str
    spec: SpecConfig | None = None
    method: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_plain(self) -> bool:
        """specfork's own plain decoding: the reference of speedups and greedy matches."""
        return self.family == "specfork" and self.spec is not None and not self.spec.drafts

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description (results.json)."""
        out: dict[str, Any] = {"label": self.label, "family": self.family}
        if self.spec is not None:
            out["config"] = self.spec.to_dict()
        else:
            out["method"] = self.method
        out["options"] = dict(self.options)
        return out


def strategy_names() -> tuple[str, ...]:
    """Every strategy name a spec may start with: specfork's (catalog.kinds), the baselines."""
    return (*STRATEGY_NAMES, *BASELINES, SERVER)


def valid_options() -> list[str]:
    """Option keys a specfork strategy spec accepts."""
    return list(OPTIONS_BY_NAME)


def parse_strategy(text: str) -> StrategySpec:
    """Parse one spec string (see the module docstring); errors are ConfigError."""
    label = text.strip()
    if not label:
        raise ConfigError("empty strategy spec; see `specfork bench --help` for the syntax")
    head, _, query = label.partition("?")
    name, colon, drafter = head.partition(":")
    name = name.strip()
    if name == SERVER:
        return _parse_server(label, drafter.strip(), query)
    drafter = drafter.strip()
    names = strategy_names()
    if name not in names:
        raise ConfigError(
            f"strategy spec {label!r}: unknown strategy {name!r}; choose one of {', '.join(names)}"
        )
    if colon and not drafter:
        raise ConfigError(f"strategy spec {label!r}: nothing after ':' (a drafter name)")
    raw = _split_options(query, label)
    if name in BASELINES:
        return _parse_baseline(label, name, drafter, raw)
    if drafter and not strategy_kind(name).drafts:
        raise ConfigError(f"strategy spec {label!r}: plain decoding ({name}) takes no drafter")
    options = _spec_options(raw, label)
    kwargs = {"strategy": name, **({"drafter": drafter} if drafter else {}), **options}
    try:
        check_used(name, list(options))
        spec = SpecConfig(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"strategy spec {label!r}: {exc}") from exc
    return StrategySpec(label, "specfork", spec=spec, options=options)


def _spec_options(raw: dict[str, str], label: str) -> dict[str, Any]:
    """The spec's options converted as the schema says (ConfigError naming the option)."""
    options: dict[str, Any] = {}
    for key, value in raw.items():
        opt = option(key, where=f"strategy spec {label!r}")
        try:
            options[opt.name] = opt.from_text(value)
        except ConfigError as exc:
            raise ConfigError(f"strategy spec {label!r}: option {key}={value!r} {exc}") from None
    return options


def parse_strategies(texts: str | Iterable[str]) -> list[StrategySpec]:
    """Parse comma-separated spec lists (one string or several, e.g. a repeated flag)."""
    items = [texts] if isinstance(texts, str) else list(texts)
    specs: list[StrategySpec] = []
    for text in items:
        specs.extend(parse_strategy(part) for part in split_strategy_list(text))
    if not specs:
        raise ConfigError("no strategies given; e.g. --strategies ar,speculative:ngram")
    seen: set[str] = set()
    for s in specs:
        if s.label in seen:
            raise ConfigError(f"strategy {s.label!r} is listed twice")
        seen.add(s.label)
    return specs


def split_strategy_list(text: str) -> list[str]:
    """Split at commas, keeping a comma inside an option value (``?t=0.3,0.6``) with it.

    A piece that does not start with a strategy name continues the previous piece when that
    piece has options; otherwise it is taken as a spec of its own (and fails as unknown).
    """
    names = strategy_names()
    parts: list[str] = []
    for piece in text.split(","):
        start = piece.strip().split("?", 1)[0].split(":", 1)[0].strip()
        if parts and start not in names and "?" in parts[-1]:
            parts[-1] += "," + piece
        else:
            parts.append(piece)
    return [p.strip() for p in parts if p.strip()]


def ensure_plain(specs: Sequence[StrategySpec]) -> tuple[list[StrategySpec], bool]:
    """The list with specfork's plain ``ar`` first-class: added at the front when missing."""
    if any(s.is_plain for s in specs):
        return list(specs), False
    return [parse_strategy("ar"), *specs], True


def _convert_scalar(value: str, hint: Any, where: str) -> Any:
    v = value.strip()
    if hint is bool:
        if v.lower() in _TRUE:
            return True
        if v.lower() in _FALSE:
            return False
        raise ConfigError(f"{where} must be true or false")
    if hint is int:
        try:
            return int(v)
        except ValueError:
            raise ConfigError(f"{where} must be an integer") from None
    if hint is float:
        try:
            return float(v)
        except ValueError:
            raise ConfigError(f"{where} must be a number") from None
    return value


def _split_options(query: str, label: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for item in query.split("&"):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ConfigError(f"strategy spec {label!r}: option {item!r} is not key=value")
        if key in _POSITIONAL:
            raise ConfigError(
                f"strategy spec {label!r}: {key} is given by the spec's prefix "
                "(strategy[:drafter]), not as an option"
            )
        if key in options:
            raise ConfigError(f"strategy spec {label!r}: option {key!r} is given twice")
        options[key] = value.strip()
    return options


def _parse_server(label: str, target: str, query: str) -> StrategySpec:
    """`openai:URL[#model]`: the URL must be http(s) with a host; no options."""
    from urllib.parse import urlsplit

    example = "e.g. openai:http://127.0.0.1:8000/v1#Qwen/Qwen3-0.6B"
    if query.strip():
        raise ConfigError(f"strategy spec {label!r}: openai: takes no options ({example})")
    url, _, model = target.partition("#")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"strategy spec {label!r}: openai: needs the server's http(s) API base URL ({example})"
        )
    if "#" in target and not model.strip():
        raise ConfigError(f"strategy spec {label!r}: nothing after '#' (a model name)")
    options = {"url": url.strip(), "model": model.strip() or None}
    return StrategySpec(label, SERVER, method="chat", options=options)


def _parse_baseline(label: str, family: str, method: str, raw: dict[str, str]) -> StrategySpec:
    """`hf:...` (transformers) or `llamacpp:...` (llama.cpp) with its options."""
    name, methods = BASELINES[family]
    if method not in methods:
        choices = ", ".join(f"{family}:{m}" for m in methods)
        raise ConfigError(f"strategy spec {label!r}: unknown {name} method; use {choices}")
    allowed = methods[method]
    options: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in allowed:
            valid = ", ".join(allowed) or "none"
            raise ConfigError(
                f"strategy spec {label!r}: unknown option {key!r} for {family}:{method}; "
                f"valid options: {valid}"
            )
        options[key] = _convert_scalar(value, allowed[key], f"strategy spec {label!r}: {key}")
    for key in ("k", "max_ngram"):
        if key in options and options[key] < 1:
            raise ConfigError(f"strategy spec {label!r}: {key} must be >= 1")
    if options.get("schedule", "constant") not in HF_SCHEDULES:
        raise ConfigError(
            f"strategy spec {label!r}: schedule must be one of {', '.join(HF_SCHEDULES)}"
        )
    if "draft" in options and not options["draft"].strip():
        raise ConfigError(f"strategy spec {label!r}: draft= needs a model name or path")
    return StrategySpec(label, family, method=method, options=options)
