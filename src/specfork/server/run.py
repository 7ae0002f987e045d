"""Running an app with uvicorn: the listening socket, and a background server for tests and
benchmarks (`serve_in_background`)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from specfork.errors import SpecforkError


def require_server_packages() -> Any:
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
    from specfork.server.shutdown import draining_server

    sock = bind_socket(host, port)
    server = draining_server(app, getattr(getattr(app, "state", None), "worker", None))
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
