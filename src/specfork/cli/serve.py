"""`specfork serve`: load a model and serve it over HTTP with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from specfork.cli.common import (
    add_model_flags,
    add_spec_flags,
    add_suffix_flags,
    kept_suffix_index,
    model_options,
    spec_from_args,
)
from specfork.engine.thread import model_thread, run_in
from specfork.errors import ConfigError, SpecforkError
from specfork.server.run import bind_socket, require_server_packages
from specfork.server.security import WILDCARD_BINDS, default_allowed_hosts
from specfork.threads import parse_threads

if TYPE_CHECKING:
    from pathlib import Path

    from specfork.config import SpecConfig
    from specfork.engine.generator import Generator

log = logging.getLogger(__name__)
SERVED_STRATEGIES = 16  # strategies kept built for requests (the most recently used)
API_KEY_ENV = "SPECFORK_API_KEY"


def add_parser(subparsers: Any) -> None:
    """Add the `serve` command to the CLI's subparsers."""
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_model_flags(p)
    add_suffix_flags(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    g.add_argument(
        "--served-model-name", default=None, help="model name clients send (default: --model)"
    )
    g.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="tokens of context per request, prompt included (default: the model's)",
    )
    g.add_argument(
        "--queue-size", type=int, default=64, help="requests that may wait; more get HTTP 429 (64)"
    )
    g.add_argument(
        "--max-running",
        type=int,
        default=8,
        metavar="N",
        help="requests decoded together in one batch (8; 1: one at a time)",
    )
    g.add_argument(
        "--step-rows",
        type=int,
        default=None,
        metavar="N",
        help="rows one forward may hold: decoding rows first, prompt chunks fill the rest "
        "(default max(128, --max-running); lower: steadier tokens while long prompts are read, "
        "higher: faster prompts)",
    )
    g.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=None,
        metavar="MB",
        help="keys/values of shared prefixes (system prompts, earlier turns) kept for later "
        "requests (default 256 on the kernels, whose outputs a cache hit cannot change; 0: off)",
    )
    g.add_argument(
        "--kv-budget-mb",
        type=float,
        default=None,
        metavar="MB",
        help="KV cache the running requests may hold together; a request that does not fit "
        "waits for others to finish (default: no cap beyond --max-running)",
    )
    g.add_argument(
        "--stream-interval",
        type=float,
        default=0.02,
        metavar="S",
        help="seconds between a stream's chunks: the first at once, then the text of every "
        "step since (0.02; 0: a chunk per step)",
    )
    g.add_argument(
        "--plain-above-queue",
        type=int,
        default=None,
        metavar="N",
        help="while more than N requests wait, new ones run plain decoding",
    )
    g.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="max_tokens of requests that give none (256)",
    )
    add_safety_flags(p)
    add_spec_flags(p)
    p.set_defaults(run=run)


def batch_settings(args: argparse.Namespace) -> dict:
    """The `ServerSettings` of batching and streaming the flags give."""
    names = ("max_running", "prefix_cache_mb", "stream_interval", "kv_budget_mb", "step_rows")
    return {name: getattr(args, name) for name in names}


def add_safety_flags(p: argparse.ArgumentParser) -> None:
    """Who may call the server and how much one request may ask for (docs/server.md)."""
    g = p.add_argument_group("access and limits")
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else none)",
    )
    g.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="NAMES",
        help="comma-separated Host header names served, '*' for any (default: loopback names "
        "and --host; any host when --host is a wildcard and an API key is set)",
    )
    g.add_argument(
        "--max-draft-nodes",
        type=int,
        default=256,
        help="tokens a request's strategy may draft per round, e.g. forks × depth (256)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="decoding time of one request; then it ends with finish_reason length (300)",
    )
    g.add_argument(
        "--max-mask-ms",
        type=float,
        default=25.0,
        metavar="MS",
        help="the mean milliseconds a request's response_format may take to mask a token; a "
        "dearer one is refused with 400 (25; 0: no limit)",
    )
    g.add_argument(
        "--fixed-strategy",
        action="store_true",
        help="refuse requests that choose their own strategy (the speculative object)",
    )
    g.add_argument(
        "--allow-lossy",
        action="store_true",
        help="let requests opt into lossy typical acceptance (speculative.lossy_typical)",
    )
    g.add_argument(
        "--metrics-prefix",
        default="specfork:",
        help="prefix of the vLLM-named spec_decode_* metrics ('vllm:' for vLLM dashboards)",
    )


def security_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerSettings fields the access-and-limits flags give."""
    if args.allowed_hosts is not None:
        hosts = tuple(h.strip() for h in args.allowed_hosts.split(","))
    elif args.host in WILDCARD_BINDS and args.api_key:
        hosts = ("*",)  # the key protects the server; any name may reach it
    else:
        hosts = default_allowed_hosts(args.host)
    if args.host in WILDCARD_BINDS and not args.api_key:
        log.warning(
            "listening on every interface without an API key: only requests naming %s in "
            "their Host header are answered (remote clients get 400); set --api-key to serve "
            "them, or --allowed-hosts with the names they use",
            ", ".join(hosts),
        )
    return {
        "api_key": args.api_key,
        "allowed_hosts": hosts,
        "max_draft_nodes": args.max_draft_nodes,
        "request_timeout": args.request_timeout,
        "max_mask_ms": args.max_mask_ms or None,
        "fixed_strategy": args.fixed_strategy,
        "allow_lossy": args.allow_lossy,
        "metrics_prefix": args.metrics_prefix,
    }


def run(args: argparse.Namespace, err_console: Console) -> int:
    """Validate the flags, load the model, serve until interrupted; returns the exit status."""
    require_server_packages()
    from specfork.server.app import create_app
    from specfork.server.shutdown import draining_server
    from specfork.strategies.policies import make_policy

    if args.default_max_tokens < 1:
        raise ConfigError(f"--default-max-tokens must be at least 1, got {args.default_max_tokens}")
    spec = spec_from_args(args, expected_length=args.default_max_tokens)
    make_policy(spec.k_policy, spec.k, spec.expected_length)  # validate before loading
    from specfork.server.worker import ServerSettings

    settings = security_settings(args)
    batching = batch_settings(args)
    ServerSettings("check", **batching, **settings)  # bad flags fail before the model loads
    if args.max_context is not None and args.max_context < 2:
        raise SpecforkError(f"--max-context must be at least 2, got {args.max_context}")
    sock = bind_socket(args.host, args.port)
    thread = model_thread()  # loads, warms and runs the model: one thread, one OpenMP pool
    with err_console.status(f"loading {escape(args.model)}…", spinner="dots"):
        generator, weights = run_in(thread, _load_generator, args, spec)
    app = create_app(
        generator,
        thread=thread,
        model_name=args.served_model_name or args.model,
        queue_size=args.queue_size,
        **batching,
        plain_above_queue=args.plain_above_queue,
        default_max_tokens=args.default_max_tokens,
        **settings,
    )
    host, port = sock.getsockname()[:2]
    model = generator.model
    threads = parse_threads(args.threads).describe()
    err_console.print(
        f"serving {args.model} ({model.describe()}, {threads}; {spec.strategy}) on "
        f"http://{host}:{port}/v1",
        markup=False,
        highlight=False,
    )
    level = "info" if getattr(args, "verbose", False) else "warning"
    server = draining_server(app, app.state.worker, log_level=level)
    with kept_suffix_index(args, generator.stores.suffix, weights):  # saved once drained
        server.run(sockets=[sock])
    return 0


def _load_generator(args: argparse.Namespace, spec: SpecConfig) -> tuple[Generator, Path]:
    """Load the model and warm it up (on the model thread, which runs every request); the
    Generator and the model's weights."""
    from specfork.engine.generator import Generator
    from specfork.loading.loader import load_model

    loaded = load_model(args.model, progress=False, **model_options(args))
    generator = Generator(
        loaded, spec=spec, max_context=args.max_context, max_strategies=SERVED_STRATEGIES
    )
    generator.warm_up()
    return generator, loaded.path
