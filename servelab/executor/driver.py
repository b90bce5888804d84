"""The pipeline's side of the executor seam: choose the executor, start its workers.

:func:`create_executor` runs in ``Pipeline.__init__`` right after the config is resolved:
every refusal (:func:`~servelab.executor.check_executor_settings`) happens there, before
any process starts. :func:`start_executor` runs once the driver's KV cache manager and
scheduler exist: the workers get the resolved pool (``num_blocks`` of ``block_size``),
``max_model_len`` and the sampling pieces, and each allocates its own pages.
"""

from __future__ import annotations

from typing import Any

from servelab.executor import check_executor_settings, get_executor
from servelab.executor.interface import Executor
from servelab.executor.worker import ModelSource, WorkerSpec

__all__ = ["create_executor", "start_executor"]


def create_executor(config: Any, model: Any, kv_connector: Any = None) -> Executor:
    """The (not yet started) executor ``config.parallel`` asks for, after every check."""
    name = check_executor_settings(config, model, device=getattr(model, "device", "cpu"), kv_connector=kv_connector)
    setting = config.parallel.distributed_executor_backend
    return get_executor(setting if setting is not None and not isinstance(setting, str) else name)


def start_executor(executor: Executor, pipeline: Any) -> Executor:
    """Start ``executor``'s workers for ``pipeline`` (its resolved pool, limits and sampler)."""
    if pipeline.kv_cache_groups is not None:
        raise ValueError(f"the {executor.name!r} executor runs one KV-cache group; this model's manager has "
                         f"{len(pipeline.kv_cache_groups)} (pass kv_cache_groups='uniform')")
    model = pipeline.model
    config = pipeline.config.replace(distributed_executor_backend=executor.name)  # an object does not pickle
    spec = WorkerSpec(source=ModelSource.of(model), config=config, max_model_len=pipeline.max_model_len,
                      block_size=pipeline.block_size, num_blocks=pipeline.num_blocks,
                      max_num_seqs=pipeline.scheduler_config.max_num_seqs, eos_token_id=pipeline.eos_token_id,
                      extra_eos=tuple(pipeline._extra_eos), sampler=pipeline.sampler,
                      kv_cache_dtype=getattr(pipeline.kv_cache_manager.spec, "dtype", None),
                      sliding_window=getattr(pipeline.kv_cache_manager.spec, "sliding_window", None),
                      device=str(model.device))
    executor.start(spec)
    return executor
