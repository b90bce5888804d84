"""``servelab serve``: an OpenAI-compatible server on an asynchronous engine.

- :mod:`~servelab.serve.engine`: :class:`AsyncPipeline` (the step loop on its
  own thread, async iterators of outputs, abort on cancel, a bounded waiting
  queue) and the :class:`AsyncEngine` interface the server needs.
- :mod:`~servelab.serve.metrics`: Prometheus metrics under vLLM's names.
- :mod:`~servelab.serve.protocol`, :mod:`~servelab.serve.chat`,
  :mod:`~servelab.serve.handlers`, :mod:`~servelab.serve.responses`: the
  OpenAI wire format, chat rendering, response bodies.
- :mod:`~servelab.serve.app`: :func:`build_app` (FastAPI; the ``serve`` extra).

The engine and the metrics need nothing beyond the core; the app needs
FastAPI and uvicorn (``pip install 'servelab[serve]'``).
"""

from __future__ import annotations

from typing import Any

from servelab.serve.engine import (
    AsyncEngine,
    AsyncPipeline,
    EngineDeadError,
    EngineFullError,
    RequestStream,
    RequestUpdate,
)
from servelab.serve.metrics import ServeMetrics

__all__ = ["AsyncEngine", "AsyncPipeline", "EngineDeadError", "EngineFullError", "RequestStream", "RequestUpdate",
           "ServeMetrics", "build_app", "require_serve_extra"]


def require_serve_extra() -> None:
    """Raise ``ImportError`` naming the ``serve`` extra when FastAPI or uvicorn is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"servelab serve needs FastAPI and uvicorn: pip install 'servelab[serve]' ({exc})") from exc


def build_app(engine: Any, *, model_name: str, chat_template: str | None = None) -> Any:
    """See :func:`servelab.serve.app.build_app` (imported on use: FastAPI is the ``serve`` extra)."""
    require_serve_extra()
    from servelab.serve.app import build_app as _build

    return _build(engine, model_name=model_name, chat_template=chat_template)
