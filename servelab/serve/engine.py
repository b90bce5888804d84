"""``AsyncPipeline``: a :class:`~servelab.Pipeline` behind an asyncio interface.

``add_request`` returns a :class:`RequestStream`, an async iterator of
:class:`RequestUpdate` (one per step that gave the request tokens, the last
with ``finished=True`` and the final :class:`~servelab.pipeline.GenerationOutput`).

Decisions:

- **The step loop runs on its own thread**, never on the event loop: a step
  is a model forward (tens of milliseconds to seconds), and PyTorch releases
  the GIL inside its kernels, so the event loop keeps accepting connections
  and streaming while a step runs. The pipeline is not thread-safe, so
  *every* call into it (add, abort, step) happens on that thread: the event
  loop only posts commands to a queue the thread drains between steps.
- **A cancelled iterator aborts its request**: a consumer task cancelled
  while it waits (a client that disconnected), ``aclose()``, or leaving an
  ``async with`` block posts an abort; the pipeline frees the request's
  blocks before its next step.
- **Backpressure**: at most ``max_waiting`` requests wait for admission
  (posted but not yet added, plus the scheduler's waiting queue, as of the
  last step); one more raises :class:`EngineFullError` at once (the server's
  503) instead of queueing without bound.
- **Shutdown** (``await shutdown()``) aborts every live request (their
  streams end with ``"abort"``), stops the thread and joins it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from servelab.pipeline.outputs import GenerationOutput, StreamEvent
from servelab.samplers import SamplingParams
from servelab.serve.metrics import ServeMetrics

__all__ = ["AsyncEngine", "AsyncPipeline", "EngineDeadError", "EngineFullError", "RequestStream", "RequestUpdate"]


class EngineFullError(RuntimeError):
    """The waiting queue is full (``max_waiting``): the request was not queued; retry later."""


class EngineDeadError(RuntimeError):
    """The engine stopped (shut down, or its step loop raised): no request is served."""


@dataclass
class RequestUpdate:
    """One request's progress in one step (a :class:`StreamEvent` plus what a server needs).

    ``new_logprobs``: per new token, ``[(sampled id, logprob), (top id, logprob), ...]``
    when the request asked for ``logprobs`` (else None). ``completion_finish_reason``
    is set on the last update of completion ``completion_index``; ``finished`` on
    the request's last update, which also carries ``output``.
    """

    request_id: str
    completion_index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[Any] | None
    completion_finish_reason: str | None
    finished: bool
    error: str | None = None
    output: GenerationOutput | None = None


@runtime_checkable
class AsyncEngine(Protocol):
    """What the server needs of an engine (:class:`AsyncPipeline`; the plain one is
    ``servelab.reference.async_engine.SerialAsyncEngine``)."""

    pipeline: Any  # the Pipeline: tokenizer, max_model_len, vocab_size
    metrics: ServeMetrics

    def add_request(self, prompt: Any, params: SamplingParams, *, request_id: str | None = None,
                    priority: int = 0) -> RequestStream:
        """Queue one request; raises :class:`EngineFullError` / :class:`EngineDeadError`."""
        ...

    async def shutdown(self) -> None:
        """Abort every live request and stop."""
        ...

    @property
    def is_running(self) -> bool:
        """False once shut down or dead."""
        ...


class RequestStream:
    """The async iterator of one request's :class:`RequestUpdate` (see the module docstring)."""

    def __init__(self, engine: Any, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.output: GenerationOutput | None = None
        self._engine, self._loop = engine, loop
        self._queue: asyncio.Queue[RequestUpdate | BaseException] = asyncio.Queue()
        self._done = False

    def _put(self, item: RequestUpdate | BaseException) -> None:
        """Called from the engine thread: hand an item to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestUpdate:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self._abort()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done, self.output = True, item.output
        return item

    def _abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        """Stop listening; a request still running is aborted (its blocks are freed)."""
        self._abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._abort()

    async def collect(self) -> GenerationOutput:
        """Wait for the end; the final output."""
        async for _ in self:
            pass
        assert self.output is not None
        return self.output


@dataclass
class _Live:
    """The engine thread's record of one live request."""

    stream: RequestStream
    arrival: float
    first_token: float | None = None
    last_token: dict[int, float] | None = None
    logprobs_seen: dict[int, int] | None = None


class AsyncPipeline:
    """An asyncio front of a :class:`~servelab.Pipeline` (see the module docstring).

    Args:
        pipeline: the pipeline (owned by the engine from now on: do not call it
            from other threads).
        max_waiting: most requests waiting for admission before
            :class:`EngineFullError` (>= 1).
        idle_wait_s: how long the idle loop sleeps between checks of the
            stop flag (commands wake it at once).
    """

    def __init__(self, pipeline: Any, *, max_waiting: int = 1024, idle_wait_s: float = 0.5) -> None:
        if not isinstance(max_waiting, int) or isinstance(max_waiting, bool) or max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting!r} is invalid; valid: an int >= 1")
        self.pipeline = pipeline
        self.max_waiting = max_waiting
        self.metrics = ServeMetrics()
        self._idle_wait_s = idle_wait_s
        self._cv = threading.Condition()
        self._commands: list[tuple[str, Any]] = []
        self._num_posted_adds = 0
        self._live: dict[str, _Live] = {}  # engine thread only
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]  # ids unique across engines over one pipeline
        self._stopping = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="servelab-engine", daemon=True)
        self._thread.start()

    # ---- the event loop's side ------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._dead is None

    def add_request(self, prompt: Any, params: SamplingParams, *, request_id: str | None = None,
                    priority: int = 0) -> RequestStream:
        """Queue one request (call from a running event loop); returns its stream.

        Raises :class:`EngineDeadError` after shutdown or a crash,
        :class:`EngineFullError` when ``max_waiting`` requests already wait.
        Bad prompts or params do not raise: the stream ends with
        ``finish_reason == "error"`` and the reason.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self._dead!r}" if self._dead else
                                  "the engine has been shut down")
        rid = request_id if request_id is not None else f"srv-{self._id_prefix}-{next(self._ids)}"
        stream = RequestStream(self, rid, asyncio.get_running_loop())
        with self._cv:
            waiting = self._num_posted_adds + self.metrics.num_waiting
            if waiting >= self.max_waiting:
                raise EngineFullError(f"the engine's waiting queue is full ({waiting} requests wait, "
                                      f"max_waiting={self.max_waiting}); retry later")
            self._num_posted_adds += 1
            self._commands.append(("add", (stream, prompt, params, priority, time.monotonic())))
            self._cv.notify()
        return stream

    async def generate(self, prompt: Any, params: SamplingParams, **kwargs: Any) -> AsyncIterator[RequestUpdate]:
        """``add_request`` as an async generator (closing it aborts the request)."""
        stream = self.add_request(prompt, params, **kwargs)
        async with stream:
            async for update in stream:
                yield update

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; a no-op for one that has ended)."""
        with self._cv:
            self._commands.append(("abort", request_id))
            self._cv.notify()

    async def shutdown(self) -> None:
        """Abort every live request, stop the step loop and join its thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ---- the engine thread ----------------------------------------------------------

    def _run(self) -> None:
        pipe = self.pipeline
        try:
            while True:
                with self._cv:
                    if not self._commands and not self._stopping and not pipe.has_unfinished_requests():
                        self._cv.wait(self._idle_wait_s)
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for kind, payload in commands:
                    self._add(*payload) if kind == "add" else self._abort(payload)
                if stopping:
                    for rid in list(self._live):
                        self._abort(rid)
                if pipe.has_unfinished_requests():
                    events = pipe.step()
                    self._dispatch(events)
                    if events:  # hand the GIL to the event loop now, so the outputs leave before the next step
                        time.sleep(0)
                self._update_gauges()
                if stopping and not self._live:
                    return
        except BaseException as exc:  # a bug below the pipeline's own isolation: every stream learns it
            self._dead = exc
            for live in self._live.values():
                live.stream._put(EngineDeadError(f"the engine's step loop failed: {type(exc).__name__}: {exc}"))
            self._live.clear()

    def _add(self, stream: RequestStream, prompt: Any, params: SamplingParams, priority: int,
             arrival: float) -> None:
        with self._cv:
            self._num_posted_adds -= 1
        if self._stopping:
            stream._put(EngineDeadError("the engine is shutting down"))
            return
        try:
            self.pipeline.add_request(prompt, params, request_id=stream.request_id, priority=priority)
        except ValueError as exc:  # a duplicate id: nothing was queued
            stream._put(exc)
            return
        self._live[stream.request_id] = _Live(stream, arrival, None, {}, {})

    def _abort(self, request_id: str) -> None:
        if request_id in self._live:
            self.pipeline.abort_request(request_id)  # its final event comes with the next step

    def _dispatch(self, events: list[StreamEvent]) -> None:
        now = time.monotonic()
        for event in events:
            live = self._live.get(event.request_id)
            if live is None:
                continue
            output = self.pipeline.get_output(event.request_id, pop=event.finished)
            update = self._update(live, event, output, now)
            if event.finished:
                del self._live[event.request_id]
                self.metrics.record_finished(output, now - live.arrival)
            live.stream._put(update)

    def _update(self, live: _Live, event: StreamEvent, output: GenerationOutput, now: float) -> RequestUpdate:
        """The update of one event; records TTFT, inter-token latency and token counts."""
        i = event.completion_index
        assert live.last_token is not None and live.logprobs_seen is not None
        new = event.new_token_ids
        if new:
            if live.first_token is None:
                live.first_token = now
                self.metrics.record_first_token(now - live.arrival, len(output.prompt_token_ids))
            elif i in live.last_token:
                self.metrics.record_inter_token(now - live.last_token[i])
            live.last_token[i] = now
            self.metrics.record_generated(len(new))
        completion = output.completions[i] if output.completions is not None else output
        new_logprobs = None
        if completion.logprobs is not None:
            seen = live.logprobs_seen.get(i, 0)
            new_logprobs = completion.logprobs[seen:seen + len(new)]
            live.logprobs_seen[i] = seen + len(new)
        return RequestUpdate(event.request_id, i, list(new), event.new_text, new_logprobs, event.finish_reason,
                             event.finished, event.error, output if event.finished else None)

    def _update_gauges(self) -> None:
        scheduler = self.pipeline.scheduler
        running = len(getattr(scheduler, "running", ()))
        waiting = len(getattr(scheduler, "waiting", ()))
        self.metrics.set_gauges(running, waiting, float(self.pipeline.kv_cache_manager.usage))
