"""The plain twin of :class:`servelab.serve.AsyncPipeline`: one request at a time, whole.

``SerialAsyncEngine`` has the :class:`~servelab.serve.engine.AsyncEngine`
interface but no concurrency: each request runs alone, to its end, through
``Pipeline.generate`` on a worker thread (a lock serialises them), and its
stream yields one update per completion carrying every token. It is the
spec the continuous-batching engine is held to: a seeded or greedy request's
tokens must not depend on which other requests share its steps.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator
from typing import Any

from servelab.pipeline.outputs import GenerationOutput
from servelab.samplers import SamplingParams
from servelab.serve.engine import EngineDeadError, RequestUpdate
from servelab.serve.metrics import ServeMetrics

__all__ = ["SerialAsyncEngine", "SerialStream"]


class SerialStream:
    """An async iterator over the updates of one request run alone."""

    def __init__(self, updates: asyncio.Future[list[RequestUpdate]], request_id: str) -> None:
        self.request_id = request_id
        self.output: GenerationOutput | None = None
        self._future = updates
        self._items: list[RequestUpdate] | None = None

    def __aiter__(self) -> SerialStream:
        return self

    async def __anext__(self) -> RequestUpdate:
        if self._items is None:
            self._items = list(await self._future)
        if not self._items:
            raise StopAsyncIteration
        item = self._items.pop(0)
        if item.finished:
            self.output = item.output
        return item

    async def aclose(self) -> None:
        self._items = []

    async def collect(self) -> GenerationOutput:
        async for _ in self:
            pass
        assert self.output is not None
        return self.output


class SerialAsyncEngine:
    """The reference engine (see the module docstring)."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        self.metrics = ServeMetrics()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._running = True

    @property
    def is_running(self) -> bool:
        return self._running

    def _run_alone(self, prompt: Any, params: SamplingParams, request_id: str) -> list[RequestUpdate]:
        with self._lock:
            [out] = self.pipeline.generate([prompt], params)
        updates = []
        for k, completion in enumerate(out.outputs):
            last = k == len(out.outputs) - 1
            updates.append(RequestUpdate(request_id, completion.index, list(completion.token_ids), completion.text,
                                         completion.logprobs, completion.finish_reason, last, completion.error,
                                         out if last else None))
        return updates

    def add_request(self, prompt: Any, params: SamplingParams, *, request_id: str | None = None,
                    priority: int = 0) -> SerialStream:
        if not self._running:
            raise EngineDeadError("the engine has been shut down")
        rid = request_id if request_id is not None else f"ref-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, self._run_alone, prompt, params, rid)
        return SerialStream(future, rid)

    async def generate(self, prompt: Any, params: SamplingParams, **kwargs: Any) -> AsyncIterator[RequestUpdate]:
        async for update in self.add_request(prompt, params, **kwargs):
            yield update

    async def shutdown(self) -> None:
        self._running = False
