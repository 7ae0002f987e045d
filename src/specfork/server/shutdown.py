"""A uvicorn server that ends its requests itself when it shuts down.

uvicorn, on SIGTERM, closes its sockets, waits `timeout_graceful_shutdown` seconds for the open
requests, cancels those left, and only then runs the app's lifespan shutdown (which stops the
engine worker). Cancelled that way, a waiting or non-streaming request got a plain-text 500 and
a stream was cut without an error event or `[DONE]`. This server drains the worker as the
shutdown starts: waiting requests get a 503 in OpenAI's error shape at once, running ones keep
decoding until a second before the grace period ends, then end with a 503 (streams: an error
event, then `[DONE]`), so every request is answered before uvicorn would cancel it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import uvicorn

from specfork.server.worker import EngineWorker

log = logging.getLogger(__name__)

GRACE_SECONDS = 5  # uvicorn's wait for open requests at shutdown
ANSWER_SECONDS = 1.0  # of it, left for the last answers to reach their clients


class DrainingServer(uvicorn.Server):
    """`uvicorn.Server` that drains `worker` when it shuts down (see the module doc)."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker) -> None:
        super().__init__(config)
        self.worker = worker

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drained = asyncio.create_task(asyncio.to_thread(self._drain))
        await super().shutdown(sockets)
        await drained

    def _drain(self) -> None:
        """503 to the waiting requests; the running ones finish or get 503 before the grace
        period ends."""
        self.worker.drain()
        grace = self.config.timeout_graceful_shutdown or 0
        deadline = time.monotonic() + max(0.0, grace - ANSWER_SECONDS)
        while self.worker.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.worker.busy:
            log.warning("shutting down: requests still running get 503")
        self.worker.stop()


def draining_server(
    app: object, worker: EngineWorker | None, log_level: str = "warning"
) -> uvicorn.Server:
    """The server `specfork serve` and `serve_in_background` run `app` with (a plain uvicorn
    server for an app without an engine worker, such as a test's stand-in)."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=GRACE_SECONDS)
    return uvicorn.Server(config) if worker is None else DrainingServer(config, worker)
