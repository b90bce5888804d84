"""The executor seam: who runs the model runner for the driver's scheduler.

The scheduler, the KV cache manager and every block table stay in the driver (the
caller's process). Each step the pipeline hands the step's
:class:`~servelab.scheduling.SchedulerOutput` to its executor and gets one
:class:`~servelab.scheduling.ModelRunnerOutput` back. An :class:`Executor` presents
exactly the part of :class:`~servelab.pipeline.runner.ModelRunner` the pipeline calls
(``execute``, ``rollback``, ``remove_request``, ``last_verification``,
``prompt_logprobs.finished``), so it *is* the pipeline's runner when the model lives
elsewhere:

- ``"uniproc"`` (:class:`~servelab.executor.uniproc.UniprocExecutor`): today's path, the
  runner in the caller's process; the default for one rank;
- ``"multiproc"`` (:class:`~servelab.executor.multiproc.MultiprocExecutor`): one spawned
  worker process per rank (tensor x pipeline parallel), each with its own runner, model
  shard and KV pages; the default for more than one rank;
- ``"ray"`` (:class:`~servelab.executor.ray_executor.RayExecutor`): the same workers as Ray
  actors (``pip install "servelab[ray]"``), for more than one machine.

Contract: ``start(spec)`` once (workers built, or a ``ValueError`` / ``RuntimeError``
saying why not; nothing left running on failure); ``execute`` / ``rollback`` /
``remove_request`` in the pipeline's order; a worker that dies or stops answering makes
``execute`` raise :class:`ExecutorDeadError` (the step's requests fail with its message)
and every later call raise it again at once (the executor is not restarted: build a new
pipeline); ``shutdown()`` is idempotent and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

from servelab.scheduling.output import ModelRunnerOutput, SchedulerOutput

__all__ = ["Executor", "ExecutorDeadError", "RemoteRanksExecutor", "sigint_deferred"]


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) until the block ends, then deliver it.

    Why: a message must reach every rank whole or not at all. A ``KeyboardInterrupt``
    raised between the writes to rank 0 and rank 1 (or inside one message's bytes) leaves
    rank 0 running a step whose collectives wait for a rank that never got it; the
    driver's rollback then waits on that rank until the collective timeout. The wait for
    the answers stays interruptible: only the sends and each answer's read are held.
    Only the main thread receives signals, so elsewhere (a server's engine thread) and
    where Python does not own the SIGINT handler this is a no-op.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    caught: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(signal.SIGINT, caught[0])
        elif caught and previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


class ExecutorDeadError(RuntimeError):
    """A worker died, hung or failed; the executor serves nothing more. The message says which and why."""


class _FinishedPromptLogprobs:
    """The driver's view of the runner's ``prompt_logprobs`` (only ``finished`` is read)."""

    def __init__(self) -> None:
        self.finished: dict[str, Any] = {}


class Executor(ABC):
    """Runs the model for the scheduler (see the module docstring).

    Attributes:
        name: the registry name.
        in_process: True when the pipeline's own in-process runner does the work
            (then the pipeline allocates the KV cache and builds the runner itself).
        world_size: ranks of one replica (tensor x pipeline parallel).
        last_verification: ``(drafts verified, drafts accepted)`` per request of the last step.
    """

    name: ClassVar[str] = "executor"
    in_process: ClassVar[bool] = False
    supports_structured_outputs: ClassVar[bool] = False

    def __init__(self) -> None:
        self.world_size = 1
        self.last_verification: list[tuple[int, int]] = []
        self.prompt_logprobs = _FinishedPromptLogprobs()
        self.kv_cache_bytes = 0

    @abstractmethod
    def start(self, spec: Any) -> None:
        """Build the workers from a :class:`~servelab.executor.worker.WorkerSpec`."""

    @abstractmethod
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the output of the last rank."""

    @abstractmethod
    def rollback(self, so: SchedulerOutput) -> None:
        """Undo ``so``'s step on every rank (the runner's ``rollback``)."""

    @abstractmethod
    def remove_request(self, req_id: str) -> None:
        """Forget a finished request on every rank (may be sent with the next step)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker (idempotent); later calls raise :class:`ExecutorDeadError`."""

    def check_health(self) -> None:
        """Raise :class:`ExecutorDeadError` if a worker is dead or unresponsive (default: never)."""

    def comm_stats(self) -> list[dict[str, float]]:
        """Per rank: ``{"comm_s", "compute_s", "steps"}`` so far (communication vs the rest of ``execute``)."""
        return []


class RemoteRanksExecutor(Executor):
    """The runner's calls for executors whose ranks run elsewhere (worker processes, Ray
    actors): one message per call to every rank, the answer of the last rank kept.

    Subclasses provide ``_send(kind, payload) -> ticket`` (the message written to every
    rank; :class:`ExecutorDeadError` once a rank is gone) and ``_receive(ticket) -> list``
    (every rank's answer, in rank order), and keep ``_dead`` (the reason, or None). Sends
    run with Ctrl-C held (:func:`sigint_deferred`): every rank gets a message or none does.
    Requests removed since the last step travel with the next step's message, so removing
    one costs no message of its own; they are forgotten only once that message is sent
    (removing is idempotent on a rank, so a resend after an interrupted wait is harmless).
    """

    _dead: str | None

    def __init__(self) -> None:
        super().__init__()
        self._removed: list[str] = []
        self._dead = None

    @abstractmethod
    def _send(self, kind: str, payload: Any) -> Any:
        """Write ``(kind, payload)`` to every rank; a ticket for :meth:`_receive`."""

    @abstractmethod
    def _receive(self, ticket: Any) -> list[Any]:
        """Every rank's answer to the message ``ticket`` names, in rank order."""

    def _call(self, kind: str, payload: Any) -> list[Any]:
        with sigint_deferred():
            ticket = self._send(kind, payload)
        return self._receive(ticket)

    def _step_call(self, kind: str, so: SchedulerOutput) -> list[Any]:
        with sigint_deferred():
            ticket = self._send(kind, (self._removed, so))
            self._removed = []
        return self._receive(ticket)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        out, verification, finished = self._step_call("execute", so)[-1]
        self.last_verification = verification
        self.prompt_logprobs.finished.update(finished)
        return out

    def rollback(self, so: SchedulerOutput) -> None:
        self.last_verification = []
        if self._dead is not None:
            return  # nothing left to undo
        self._step_call("rollback", so)

    def remove_request(self, req_id: str) -> None:
        self.prompt_logprobs.finished.pop(req_id, None)
        if self._dead is None:
            self._removed.append(req_id)

    def comm_stats(self) -> list[dict[str, float]]:
        return self._call("stats", None)
