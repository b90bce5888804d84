"""``"multiproc"``: one spawned worker process per rank, driven over pipes.

**Message queue: pipes, each message pickled once.** A step's
``SchedulerOutput`` (with the ids of requests finished since the last step) is pickled
once in the driver and the same bytes are written to every rank's pipe
(``Connection.send_bytes``); each rank answers on its pipe, the last rank with the
runner's output and the others with an empty acknowledgement (so a failing rank is
seen at once). Pipes, not shared memory: on a CPU a step's message is a few KB and
the pipe write is ~10 us per rank; a shared-memory ring would save a copy per rank,
which a study of large TP groups on GPUs would want (the seam is :meth:`_broadcast`).

**Process groups** are made by the workers (:func:`~servelab.executor.parallel_state.init_parallel_state`,
gloo on a CPU and NCCL on CUDA) through a file store in a private temporary
folder (no port to race for).

**Faults.** Each worker's heartbeat thread stamps a shared clock every
:data:`HEARTBEAT_S`; while the driver waits for a step it watches every worker's
process sentinel (death: seen at once) and heartbeat (a stopped or frozen process:
seen after ``heartbeat_timeout_s``, default 5 s), and collectives time out after
``collective_timeout_s`` (a rank stuck on a dead peer). Any of these, or a worker
raising, kills every worker and makes the executor dead: the step's requests fail with
the reason, and every later step fails its requests with it (the group is not
restarted). Workers ignore SIGINT (the driver decides; a Ctrl-C in the caller
interrupts the wait, the pipeline rolls the step back and the workers stay usable; the
driver holds it while it writes a message or reads an answer, so a message is never
split between ranks),
die with the driver (``PR_SET_PDEATHSIG`` on Linux, and a parent check in the heartbeat
thread), and are killed by :meth:`MultiprocExecutor.shutdown`, which also runs when the
executor is garbage-collected or the interpreter exits.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing.connection import wait
from typing import Any, ClassVar

from servelab.executor.interface import ExecutorDeadError, RemoteRanksExecutor, sigint_deferred
from servelab.executor.parallel_state import default_backend
from servelab.executor.worker import WorkerClock, WorkerSpec, build_worker_runner, error_text, handle_message

__all__ = ["HEARTBEAT_S", "MultiprocExecutor"]

#: seconds between a worker's heartbeat stamps
HEARTBEAT_S = 0.5
#: seconds a worker may take to build its model part and KV pages
START_TIMEOUT_S = 300.0


def _set_parent_death_signal() -> None:
    """Linux: the kernel kills this process when its parent dies (no orphan after a driver crash)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the heartbeat thread's parent check does it


def _heartbeat(stamp: Any, parent: int) -> None:
    while True:
        stamp.value = time.time()
        if os.getppid() != parent:  # the driver is gone
            os._exit(1)
        time.sleep(HEARTBEAT_S)


def worker_main(rank: int, spec: WorkerSpec, init_method: str, conn: Any, stamp: Any, parent: int) -> None:
    """One rank's process: join the group, build the runner, answer messages until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_parent_death_signal()
    threading.Thread(target=_heartbeat, args=(stamp, parent), daemon=True).start()
    import torch

    from servelab.executor.parallel_state import init_parallel_state

    torch.set_num_threads(spec.threads_per_worker)
    par = spec.config.parallel
    try:
        state = init_parallel_state(rank, par.tensor_parallel_size, par.pipeline_parallel_size,
                                    init_method=init_method, backend=default_backend(spec.device),
                                    timeout_s=spec.collective_timeout_s)
        runner = build_worker_runner(spec, state)
        conn.send((0, "ok", {"kv_cache_bytes": runner.kv_cache_bytes}))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which fails the start
        conn.send((0, "error", error_text(exc)))
        return
    clock = WorkerClock()
    while True:
        try:
            seq, kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the driver closed the pipe
        if kind == "close":
            conn.send((seq, "ok", None))
            break
        try:
            conn.send((seq, "ok", handle_message(runner, state, clock, kind, payload)))
        except Exception as exc:  # noqa: BLE001 - the driver fails the step and stops the group
            conn.send((seq, "error", error_text(exc)))
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Spawn without re-running the caller's script in the worker (``python script.py`` without an
    ``if __name__ == "__main__"`` guard would otherwise build a pipeline in every worker): the main
    module's path is hidden while the process starts. Objects the worker needs must then come from
    importable modules, not from the script itself."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or getattr(getattr(main, "__spec__", None), "name", None):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _kill(processes: list[Any], conns: list[Any], folder: str | None) -> None:
    """Close the pipes, then terminate, then kill whatever is left; remove the store folder."""
    for conn in conns:
        try:
            conn.close()
        except OSError:
            pass
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 2.0
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


class MultiprocExecutor(RemoteRanksExecutor):
    """Worker processes for a replica's ranks (see the module docstring).

    Args:
        heartbeat_timeout_s: a worker whose heartbeat is older than this is declared hung.
        collective_timeout_s: how long a collective waits for a peer.
    """

    name: ClassVar[str] = "multiproc"

    def __init__(self, *, heartbeat_timeout_s: float = 5.0, collective_timeout_s: float = 30.0) -> None:
        super().__init__()
        if not heartbeat_timeout_s > 2 * HEARTBEAT_S:
            raise ValueError(f"heartbeat_timeout_s={heartbeat_timeout_s!r} is too short; valid: > {2 * HEARTBEAT_S}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.processes: list[Any] = []
        self._conns: list[Any] = []
        self._stamps: list[Any] = []
        self._seq = 0
        self._finalizer: Any = None

    # ---- lifecycle ---------------------------------------------------------------

    def start(self, spec: WorkerSpec) -> None:
        import torch.multiprocessing as tmp

        spec.collective_timeout_s = self.collective_timeout_s
        self.world_size = spec.config.parallel.world_size
        ctx = tmp.get_context("spawn")
        folder = tempfile.mkdtemp(prefix="servelab-dist-")
        init_method = f"file://{os.path.join(folder, 'store')}"
        self._finalizer = weakref.finalize(self, _kill, self.processes, self._conns, folder)
        try:
            for rank in range(self.world_size):
                parent, child = ctx.Pipe(duplex=True)
                stamp = ctx.Value("d", time.time(), lock=False)
                proc = ctx.Process(target=worker_main, args=(rank, spec, init_method, child, stamp, os.getpid()),
                                   name=f"servelab-rank{rank}", daemon=True)
                with _main_not_rerun():
                    proc.start()
                child.close()
                self.processes.append(proc)
                self._conns.append(parent)
                self._stamps.append(stamp)
            answers = self._collect(0, timeout_s=START_TIMEOUT_S, starting=True)
        except BaseException:
            self.shutdown()
            raise
        self.kv_cache_bytes = int(answers[0]["kv_cache_bytes"]) if answers else 0

    def shutdown(self) -> None:
        """Ask the workers to stop, then kill what is left; idempotent."""
        if self._dead is None:
            self._dead = "the executor was shut down (pipeline closed)"
            payload = pickle.dumps((-1, "close", None))
            for conn in self._conns:
                try:
                    conn.send_bytes(payload)
                except OSError:
                    pass
            deadline = time.monotonic() + 2.0
            for proc in self.processes:
                proc.join(max(0.0, deadline - time.monotonic()))
        if self._finalizer is not None:
            self._finalizer()

    def _fail(self, reason: str) -> ExecutorDeadError:
        """Kill every worker, remember why; returns the error to raise."""
        if self._dead is None:
            self._dead = reason
        if self._finalizer is not None:
            self._finalizer()
        return ExecutorDeadError(self._dead)

    # ---- messages ------------------------------------------------------------------

    def _broadcast(self, kind: str, payload: Any) -> int:
        """Pickle ``(seq, kind, payload)`` once and write it to every rank; returns ``seq``."""
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        self._seq += 1
        data = pickle.dumps((self._seq, kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError as exc:
                raise self._fail(f"rank {rank} cannot be reached ({type(exc).__name__}: {exc})") from None
        return self._seq

    def _collect(self, seq: int, *, timeout_s: float | None = None, starting: bool = False) -> list[Any]:
        """Every rank's answer to message ``seq`` (stale answers of an interrupted wait are dropped)."""
        answers: dict[int, Any] = {}
        by_handle = {conn: r for r, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: r for r, proc in enumerate(self.processes)}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(answers) < len(self._conns):
            waiting = [c for c, r in by_handle.items() if r not in answers]
            for handle in wait([*waiting, *sentinels], timeout=HEARTBEAT_S):
                if handle in sentinels:
                    raise self._fail(self._death_reason(sentinels[handle]))
                rank = by_handle[handle]
                try:
                    with sigint_deferred():  # a half-read answer would desynchronise the pipe
                        got, status, value = self._conns[rank].recv()
                except (EOFError, OSError):  # its pipe closed: it is exiting (the sentinel may come later)
                    raise self._fail(self._death_reason(rank)) from None
                if got != seq:
                    continue  # the answer to a message whose wait was interrupted
                if status == "error":
                    what = "failed to start" if starting else "raised"
                    raise self._fail(f"worker rank {rank} {what}: {value}")
                answers[rank] = value
            self._check_heartbeats(starting)
            if deadline is not None and time.monotonic() > deadline:
                raise self._fail(f"workers did not answer within {timeout_s:.0f} s")
        return [answers[r] for r in range(len(self._conns))]

    def _death_reason(self, rank: int) -> str:
        """Why rank ``rank`` exited: its last error message if it sent one, else its exit code."""
        conn, proc = self._conns[rank], self.processes[rank]
        try:
            while conn.poll(0):
                _, status, value = conn.recv()
                if status == "error":
                    return f"worker rank {rank} raised: {value}"
        except (EOFError, OSError):
            pass
        proc.join(1.0)
        return f"worker rank {rank} died (exit code {proc.exitcode})"

    def _check_heartbeats(self, starting: bool) -> None:
        now = time.time()
        for rank, stamp in enumerate(self._stamps):
            age = now - stamp.value
            if age > self.heartbeat_timeout_s and not (starting and age < START_TIMEOUT_S):
                raise self._fail(f"worker rank {rank} is unresponsive (no heartbeat for {age:.1f} s)")

    def check_health(self) -> None:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        for rank, proc in enumerate(self.processes):
            if not proc.is_alive():
                raise self._fail(self._death_reason(rank))
        self._check_heartbeats(False)

    def _send(self, kind: str, payload: Any) -> int:
        return self._broadcast(kind, payload)

    def _receive(self, ticket: int) -> list[Any]:
        return self._collect(ticket)
