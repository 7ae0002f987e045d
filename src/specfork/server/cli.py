"""`specfork serve`: load a model and serve it over HTTP with uvicorn.

`serve_in_background` runs an app on a loopback port in a thread (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from specfork.engine.thread import model_thread, run_in
from specfork.errors import SpecforkError

if TYPE_CHECKING:
    from specfork.config import SpecConfig
    from specfork.engine import Generator

log = logging.getLogger(__name__)


def add_serve_parser(subparsers: Any) -> None:
    """Add the `serve` command to the CLI's subparsers."""
    from specfork.cli import _add_model_flags, _add_strategy_flags

    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_model_flags(p)
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
    _add_strategy_flags(p)


def run_serve(args: argparse.Namespace, err_console: Console) -> int:
    """Validate the flags, load the model, serve until interrupted; returns the exit status."""
    uvicorn = _require_server_packages()
    from specfork.cli import spec_from_args
    from specfork.server.app import create_app
    from specfork.strategies.policies import make_policy

    spec = spec_from_args(args, expected_length=args.default_max_tokens)
    make_policy(spec.k_policy, spec.k, spec.expected_length)  # validate before loading
    if args.max_context is not None and args.max_context < 2:
        raise SpecforkError(f"--max-context must be at least 2, got {args.max_context}")
    sock = bind_socket(args.host, args.port)
    thread = model_thread()  # loads, warms and runs the model: one thread, one OpenMP pool
    with err_console.status(f"loading {escape(args.model)}…", spinner="dots"):
        generator = run_in(thread, _load_generator, args, spec)
    app = create_app(
        generator,
        thread=thread,
        model_name=args.served_model_name or args.model,
        queue_size=args.queue_size,
        plain_above_queue=args.plain_above_queue,
        default_max_tokens=args.default_max_tokens,
    )
    host, port = sock.getsockname()[:2]
    err_console.print(
        f"serving {args.model} ({spec.strategy}) on http://{host}:{port}/v1",
        markup=False,
        highlight=False,
    )
    level = "info" if getattr(args, "verbose", False) else "warning"
    server = uvicorn.Server(uvicorn.Config(app, log_level=level, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0


def _load_generator(args: argparse.Namespace, spec: SpecConfig) -> Generator:
    """Load the model and warm it up (on the model thread, which runs every request)."""
    from specfork.cli import model_options
    from specfork.engine import Generator
    from specfork.loading.loader import load_model

    loaded = load_model(args.model, progress=False, **model_options(args))
    generator = Generator(loaded, spec=spec, max_context=args.max_context)
    generator.warm_up()
    return generator


def _require_server_packages() -> Any:
    """uvicorn (after checking that fastapi and prometheus-client are there too)."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise SpecforkError(
            f"specfork serve needs fastapi, uvicorn and prometheus-client ({exc}); "
            "install them with: pip install fastapi uvicorn prometheus-client"
        ) from exc
    return uvicorn


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; a SpecforkError names the problem (port taken, bad address)."""
    if not 0 <= port < 65536:
        raise SpecforkError(f"--port must be in 0-65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise SpecforkError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


@contextmanager
def serve_in_background(app: Any, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run `app` with uvicorn in a thread; yields its base URL (http://host:port)."""
    import uvicorn

    sock = bind_socket(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server failed to start")
            thread.join(0.05)
        bound_host, bound_port = sock.getsockname()[:2]
        yield f"http://{bound_host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
