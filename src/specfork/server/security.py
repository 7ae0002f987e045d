"""Who may call the server: an ASGI guard in front of every route.

Three checks, in order, each answered in OpenAI's error shape:

- **Host allow-list** (every route): a Host header naming another machine is refused (400), so
  a web page that rebinds its own DNS name to 127.0.0.1 cannot reach a loopback server. The
  default list is the loopback names plus the address the server listens on.
- **API key** (`/v1/*`, when the server has one): `Authorization: Bearer KEY`, compared in
  constant time; 401 otherwise. `/health` and `/metrics` stay open for probes and scrapers.
- **JSON only** (POST): any other Content-Type (a browser's `text/plain` form post, which needs
  no CORS preflight) is refused with 415 before the body is read.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """Loopback names, and the address the server listens on unless it is a wildcard."""
    extra = () if bind_host in WILDCARD_BINDS or bind_host in LOOPBACK_HOSTS else (bind_host,)
    return (*LOOPBACK_HOSTS, *extra)


def host_name(header: str) -> str:
    """The host of a Host header, without port or IPv6 brackets, lower-cased."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8000
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True, slots=True)
class Guard:
    """ASGI middleware: Host allow-list, bearer API key on /v1/*, JSON-only POST bodies.

    `allowed_hosts` of ("*",) allows any Host; `api_key` None serves without authentication.
    """

    app: Any
    api_key: str | None
    allowed_hosts: Sequence[str]
    on_refusal: Callable[[str, int], None] | None = None  # (path, status) of each refusal

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        if self.on_refusal is not None:
            self.on_refusal(scope.get("path", ""), refusal[0])
        await _send_error(send, *refusal)

    def refusal(self, scope: dict) -> tuple[int, str, str, list[tuple[bytes, bytes]]] | None:
        """(status, message, code, extra headers) of a refused request, or None."""
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        host = headers.get(b"host", b"").decode("latin-1")
        if "*" not in self.allowed_hosts and host_name(host) not in self.allowed_hosts:
            return (
                400,
                f"the Host header {host!r} is not one this server answers to; start it with "
                f"--allowed-hosts naming that host (or '*' to allow any)",
                "invalid_host",
                [],
            )
        path = scope.get("path", "")
        if self.api_key is not None and (path == "/v1" or path.startswith("/v1/")):
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            expected = self.api_key.encode()
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected)
            if not ok:
                return (
                    401,
                    "a valid API key is required: send the header 'Authorization: Bearer KEY' "
                    "with the key the server was started with (--api-key / SPECFORK_API_KEY)",
                    "invalid_api_key",
                    [(b"www-authenticate", b"Bearer")],
                )
        if scope.get("method") == "POST":
            media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
            if media != b"application/json":
                shown = media.decode("latin-1") or "none"
                return (
                    415,
                    f"the request body must be JSON sent with 'Content-Type: application/json' "
                    f"(got {shown}); with curl add -H 'Content-Type: application/json'",
                    "unsupported_media_type",
                    [],
                )
        return None


def _error_type(status: int) -> str:
    return "authentication_error" if status == 401 else "invalid_request_error"


async def _send_error(
    send: Any, status: int, message: str, code: str, extra: list[tuple[bytes, bytes]]
) -> None:
    body = {"error": {"message": message, "type": _error_type(status), "param": None, "code": code}}
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + extra})
    await send({"type": "http.response.body", "body": data})
