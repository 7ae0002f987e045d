"""OpenAI-compatible HTTP server: `create_app(generator, model_name=...)` and `specfork serve`.

FastAPI and uvicorn are imported only when the server is used, so the rest of specfork runs
without them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def create_app(*args: Any, **kwargs: Any) -> Any:
    """See `specfork.server.app.create_app`."""
    from specfork.server.app import create_app as _create_app

    return _create_app(*args, **kwargs)
