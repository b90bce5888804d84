"""Executors (who runs the model for the scheduler), process groups, and tensor/pipeline parallelism.

Registry::

    register_executor(name, factory, *, override=False)   # factory(**kwargs) -> Executor
    get_executor(name_or_executor, **kwargs)
    available_executors()   # multiproc, ray, uniproc

``Pipeline(model, tensor_parallel_size=2)`` (or ``pipeline_parallel_size=2``) runs on
``"multiproc"`` worker processes; ``distributed_executor_backend=`` picks another executor
(a name or an :class:`Executor` object). See :mod:`servelab.executor.interface` (the seam),
:mod:`servelab.executor.parallel_state` (the rank grid and process groups, for other
parallel pieces), :mod:`servelab.executor.layers` and :mod:`servelab.executor.sharding`
(the sharded layers) and ``docs/parallel.md``.
"""

from __future__ import annotations

import os
from typing import Any

from servelab._internal.registry import Registry
from servelab.executor.interface import Executor, ExecutorDeadError
from servelab.executor.parallel_state import (GroupCoordinator, ParallelState, get_parallel_state,
                                              init_parallel_state, set_parallel_state)

__all__ = ["Executor", "ExecutorDeadError", "GroupCoordinator", "MAX_CPU_WORLD_SIZE", "ParallelState",
           "available_executors", "check_executor_settings", "get_executor",
           "get_parallel_state", "init_parallel_state", "register_executor", "set_parallel_state"]


def _check_executor(obj: Any) -> None:
    if not isinstance(obj, Executor):
        raise TypeError(f"an executor must be a servelab.executor.Executor, got {type(obj).__name__}")


_EXECUTORS: Registry[Any] = Registry("executor", factory=True, check=_check_executor)
_EXECUTORS.register("uniproc", "servelab.executor.uniproc:UniprocExecutor")
_EXECUTORS.register("multiproc", "servelab.executor.multiproc:MultiprocExecutor")
_EXECUTORS.register("ray", "servelab.executor.ray_executor:RayExecutor")

#: the most ranks of one replica on a CPU (gloo): each rank is a process with its own threads
MAX_CPU_WORLD_SIZE = 16


def register_executor(name: str, factory: Any, *, override: bool = False) -> None:
    """Register an executor factory (a class or ``"module:attr"``) under ``name``."""
    _EXECUTORS.register(name, factory, override=override)


def get_executor(name_or_executor: Any, **kwargs: Any) -> Executor:
    """A new executor by name (``kwargs`` to its factory), or the given :class:`Executor` object."""
    if isinstance(name_or_executor, Executor):
        return name_or_executor
    return _EXECUTORS.get(name_or_executor, **kwargs)


def available_executors() -> list[str]:
    """The registered executor names, sorted."""
    return _EXECUTORS.available()


def _backend_name(setting: Any, world_size: int) -> str:
    if setting is None:
        return "uniproc" if world_size == 1 else "multiproc"
    if isinstance(setting, str):
        return setting
    return str(getattr(setting, "name", type(setting).__name__))


def check_executor_settings(config: Any, model: Any, *, device: Any = "cpu", kv_connector: Any = None) -> str:
    """Every refusal of a parallel setting, before any process starts; returns the executor name.

    ``ValueError`` for: a grid the model cannot be cut into (heads, KV heads, MLP width,
    vocabulary, layers: :func:`servelab.executor.sharding.check_parallel`),
    ``data_parallel_size > 1`` on one pipeline (replicas are :class:`servelab.cluster.replicas.Replicas`),
    more ranks than the backend allows (gloo: :data:`MAX_CPU_WORLD_SIZE`; NCCL: the visible
    GPUs), ``"uniproc"`` with more than one rank, and pieces that live in the driver's process
    only when the model does not (a KV connector, a model-based or custom drafter,
    several KV-cache groups, an unregistered executor name).
    """
    par = config.parallel
    world = par.world_size
    name = _backend_name(par.distributed_executor_backend, world)
    if isinstance(par.distributed_executor_backend, str) and name not in _EXECUTORS:
        raise ValueError(f"distributed_executor_backend={name!r} is not registered; valid: "
                         f"{', '.join(available_executors())}")
    if par.data_parallel_size > 1:
        raise ValueError(f"data_parallel_size={par.data_parallel_size} asks for replicas; one Pipeline is one "
                         "replica: use servelab.cluster.replicas.Replicas(path, num_replicas=...) behind a router")
    if name == "uniproc" and world > 1:
        raise ValueError(f"distributed_executor_backend='uniproc' runs one rank; tensor_parallel_size="
                         f"{par.tensor_parallel_size} x pipeline_parallel_size={par.pipeline_parallel_size} "
                         f"needs 'multiproc' or 'ray'")
    if world == 1 and name == "uniproc":
        return name
    import torch

    from servelab.executor.sharding import check_parallel

    check_parallel(par, model.config)
    if torch.device(device).type == "cuda":
        limit, what = torch.cuda.device_count(), "visible CUDA devices (NCCL: one rank per GPU)"
    else:
        limit, what = MAX_CPU_WORLD_SIZE, "ranks on a CPU (gloo; servelab.executor.MAX_CPU_WORLD_SIZE)"
    if world > limit:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {world} ranks exceeds the {limit} "
                         f"{what}")
    if kv_connector is not None:
        raise ValueError("kv_connector needs the KV pages in the driver's process; it cannot be combined with "
                         f"distributed_executor_backend={name!r} (world size {world})")
    drafter = config.speculative.drafter
    if drafter is not None and drafter not in ("ngram", "ngram_tree"):
        raise ValueError(f"drafter={drafter!r} runs a model in the driver's process; with world size {world} "
                         "only the model-free drafters 'ngram' and 'ngram_tree' are supported")
    return name

