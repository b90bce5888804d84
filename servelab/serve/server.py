"""Running the app: :func:`run_server` (blocking, the CLI's) and :class:`BackgroundServer`
(uvicorn on a thread, for tests, notebooks and benchmarks; loopback by default)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from servelab.serve import build_app, require_serve_extra
from servelab.serve.engine import AsyncPipeline

__all__ = ["BackgroundServer", "free_port", "run_server"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _config(pipeline: Any, model_name: str, host: str, port: int, *, max_waiting: int,
            chat_template: str | None, log_level: str) -> Any:
    require_serve_extra()
    import uvicorn

    engine = AsyncPipeline(pipeline, max_waiting=max_waiting)
    app = build_app(engine, model_name=model_name, chat_template=chat_template)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=5), engine


def run_server(pipeline: Any, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
               max_waiting: int = 1024, chat_template: str | None = None, log_level: str = "info") -> None:
    """Serve ``pipeline`` until interrupted (uvicorn on the calling thread)."""
    import uvicorn

    config, _ = _config(pipeline, model_name, host, port, max_waiting=max_waiting, chat_template=chat_template,
                        log_level=log_level)
    uvicorn.Server(config).run()


class BackgroundServer:
    """``servelab serve`` in this process, on a thread: ``with BackgroundServer(pipe, "m") as server: server.url``.

    ``url`` is the API base (``http://127.0.0.1:PORT/v1``), ``root`` the server's.
    Leaving the block (or :meth:`stop`) shuts the engine down and joins the thread.
    """

    def __init__(self, pipeline: Any, model_name: str, *, host: str = "127.0.0.1", port: int | None = None,
                 max_waiting: int = 1024, chat_template: str | None = None, startup_timeout_s: float = 30.0) -> None:
        import uvicorn

        port = port if port is not None else free_port(host)
        config, self.engine = _config(pipeline, model_name, host, port, max_waiting=max_waiting,
                                      chat_template=chat_template, log_level="warning")
        self.root = f"http://{host}:{port}"
        self.url = self.root + "/v1"
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="servelab-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.root}")
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
