"""``"ray"``: the workers as Ray actors (``pip install "servelab[ray]"``), for more than one machine.

The same rank code as ``"multiproc"`` (:mod:`servelab.executor.worker`: the rank's model
part, KV pages and runner, and :func:`~servelab.executor.worker.handle_message`), in one
Ray actor per rank instead of a spawned process. Each step's message is put into Ray's
object store once (``ray.put``) and every actor reads that one object; the last rank's
answer is the step's output. Process groups are made as in ``"multiproc"`` (gloo/NCCL)
through ``init_method``: a file store in a temporary folder by default, which every
actor must see (one machine, or a shared filesystem); pass
``RayExecutor(init_method="tcp://HOST:PORT")`` across machines.

Faults: an actor that dies raises Ray's actor error and a step that does not finish in
``step_timeout_s`` is a hang; either makes the executor dead (its actors killed, the
step's requests failed with the reason, later work refused), as ``"multiproc"``.
``ray.init()`` is called if Ray is not yet initialised (a local cluster); the executor
never shuts Ray itself down.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, ClassVar

from servelab.executor.interface import ExecutorDeadError, RemoteRanksExecutor
from servelab.executor.worker import WorkerSpec

__all__ = ["RayExecutor"]


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError('the "ray" executor needs Ray: pip install "servelab[ray]"') from None
    return ray


class _RankActor:
    """One rank inside a Ray actor (the class is wrapped with ``ray.remote`` at start)."""

    def __init__(self, rank: int, spec: WorkerSpec, init_method: str) -> None:
        self.rank, self.spec, self.init_method = rank, spec, init_method

    def setup(self) -> int:
        import torch

        from servelab.executor.parallel_state import default_backend, init_parallel_state
        from servelab.executor.worker import WorkerClock, build_worker_runner

        torch.set_num_threads(self.spec.threads_per_worker)
        par = self.spec.config.parallel
        self.state = init_parallel_state(self.rank, par.tensor_parallel_size, par.pipeline_parallel_size,
                                         init_method=self.init_method, backend=default_backend(self.spec.device),
                                         timeout_s=self.spec.collective_timeout_s)
        self.runner = build_worker_runner(self.spec, self.state)
        self.clock = WorkerClock()
        return int(self.runner.kv_cache_bytes)

    def pid(self) -> int:
        return os.getpid()

    def handle_ref(self, message: tuple[str, Any]) -> Any:
        """``message`` is the one object the driver put (Ray resolves a top-level reference)."""
        from servelab.executor.worker import handle_message

        kind, payload = message
        return handle_message(self.runner, self.state, self.clock, kind, payload)


class RayExecutor(RemoteRanksExecutor):
    """Ray actors for a replica's ranks (see the module docstring).

    Args:
        step_timeout_s: a step not answered within this is a hang.
        start_timeout_s: how long the actors may take to start and build their parts.
        init_method: the process-group rendezvous (default: a file in a temporary folder).
        ray_init_kwargs: passed to ``ray.init`` when Ray is not initialised yet.
    """

    name: ClassVar[str] = "ray"

    def __init__(self, *, step_timeout_s: float = 60.0, start_timeout_s: float = 600.0, init_method: str | None = None,
                 ray_init_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        _ray()  # the ImportError naming the extra, before anything starts
        self.step_timeout_s, self.start_timeout_s = step_timeout_s, start_timeout_s
        self.init_method = init_method
        self.ray_init_kwargs = dict(ray_init_kwargs or {})
        self.actors: list[Any] = []
        self._folder: str | None = None
        self._started_ray = False

    def start(self, spec: WorkerSpec) -> None:
        ray = _ray()
        if not ray.is_initialized():
            ray.init(**{"include_dashboard": False, "log_to_driver": False, **self.ray_init_kwargs})
            self._started_ray = True  # a local cluster of our own: ended with the executor (no orphans)
        self.world_size = spec.config.parallel.world_size
        if self.init_method is None:
            self._folder = tempfile.mkdtemp(prefix="servelab-ray-")
            self.init_method = f"file://{os.path.join(self._folder, 'store')}"
        actor_class = ray.remote(num_cpus=0)(_RankActor)
        try:
            self.actors = [actor_class.remote(rank, spec, self.init_method) for rank in range(self.world_size)]
            sizes = self._get([a.setup.remote() for a in self.actors], "start", self.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.kv_cache_bytes = int(sizes[0])

    def _get(self, refs: list[Any], what: str, timeout_s: float | None = None) -> list[Any]:
        ray = _ray()
        timeout_s = self.step_timeout_s if timeout_s is None else timeout_s
        try:
            return list(ray.get(refs, timeout=timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise self._fail(f"a Ray worker did not answer the {what} within {timeout_s:.0f} s") from None
        except ray.exceptions.RayActorError as exc:
            raise self._fail(f"a Ray worker died during the {what}: {str(exc).splitlines()[0]}") from None
        except ray.exceptions.RayTaskError as exc:
            raise self._fail(f"a Ray worker raised during the {what}: {str(exc).splitlines()[-1]}") from None

    def _fail(self, reason: str) -> ExecutorDeadError:
        self._dead = self._dead or reason
        self._kill()
        return ExecutorDeadError(self._dead)

    def _kill(self) -> None:
        ray = _ray()
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "the executor was shut down (pipeline closed)"
        self._kill()
        if self._started_ray:  # the local cluster ray.init started for us; a cluster we joined stays up
            self._started_ray = False
            _ray().shutdown()

    def _send(self, kind: str, payload: Any) -> tuple[str, list[Any]]:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        ray = _ray()
        ref = ray.put((kind, payload))  # one object, read by every rank
        return kind, [a.handle_ref.remote(ref) for a in self.actors]

    def _receive(self, ticket: tuple[str, list[Any]]) -> list[Any]:
        kind, refs = ticket
        return self._get(refs, kind)

    def worker_pids(self) -> list[int]:
        """The actors' process ids (tests)."""
        return self._get([a.pid.remote() for a in self.actors], "pid query")

