"""The pieces a :class:`~servelab.pipeline.Pipeline` is built from, resolved
from its :class:`~servelab.config.PipelineConfig`: the attention backend
(``"auto"`` resolved against the model), the KV cache manager and its pool
size, the drafter. Each function checks what it builds and says why it cannot.

**One straight path.** The pipeline resolves its config once (flat settings
into sections, checked), then builds each part in this order, every step
reading the resolved config and the parts built before it, none writing the
config back:

1. the model (:func:`prepare_model`: sharding, weight quantization, LoRA
   wrappers, in :data:`MODEL_STEPS` order, on the :mod:`servelab.models.layer_api`
   interface);
2. ``max_model_len`` (:func:`resolve_max_model_len`), the KV cache manager and
   its pool (:func:`build_kv_cache_manager`; sizing in
   :mod:`servelab.pipeline.sizing`, several groups in :mod:`servelab.pipeline.hybrid`);
3. the attention backend and the paged buffers, checked together
   (:func:`attach_attention`, :func:`check_attention`);
4. the KV connector, the scheduler (:func:`build_scheduler`), the drafter
   (:func:`build_drafter`) and the model runner.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from servelab._internal.conformance import check_conforms
from servelab.attention.backends import default_attention_backend
from servelab.blocks import KVCacheManager
from servelab.blocks.interfaces import KVCacheManagerProtocol
from servelab.blocks.kv_quant import is_quantized_dtype, kv_cache_storage
from servelab.config import PipelineConfig
from servelab.models import kv_cache_spec
from servelab.pipeline.hybrid import build_hybrid_kv_cache_manager, check_groups_fit, wants_kv_cache_groups
from servelab.samplers.drafters import DraftModelDrafter, resolve_drafter
from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.interfaces import SchedulerInterface
from servelab.scheduling.schedulers import get_scheduler
from servelab.pipeline.sizing import check_pool_fits, default_num_blocks


@dataclass(frozen=True)
class ModelStep:
    """One transformation of the model, applied by :func:`prepare_model` when ``active(config)``.

    Attributes:
        setting: the config setting it serves (named in refusals).
        target: ``"module:function"``, imported only when active; the function takes
            ``(model, config)`` and returns the model (changed in place or replaced).
        active: whether the resolved config asks for this step.
    """

    setting: str
    target: str
    active: Callable[[PipelineConfig], bool]


def _quantization_active(config: PipelineConfig) -> bool:
    q = config.quantization
    return not (q is None or (isinstance(q, str) and q in ("auto", "none")))


#: The model steps in order: a layer is sharded first (each rank's slice of the float or
#: checkpoint weight), then quantized (per shard), then wrapped for LoRA (over whatever it
#: now is); see :mod:`servelab.models.layer_api`. Tensor-parallel sharding runs inside each
#: rank's worker (:mod:`servelab.executor`), which calls :func:`prepare_model` with its rank.
MODEL_STEPS: tuple[ModelStep, ...] = (
    ModelStep("tensor_parallel_size", "servelab.executor.sharding:shard_model",
              lambda c: c.parallel.tensor_parallel_size > 1),
    ModelStep("enable_expert_parallel", "servelab.moe.parallel:shard_experts",
              lambda c: c.parallel.enable_expert_parallel and c.parallel.tensor_parallel_size > 1),
    ModelStep("quantization", "servelab.quantization.apply:quantize_model", _quantization_active),
    ModelStep("enable_lora", "servelab.lora.apply:attach_lora", lambda c: c.lora.enable_lora),
)


def prepare_model(model: Any, config: PipelineConfig, *, steps: tuple[ModelStep, ...] = MODEL_STEPS,
                  **context: Any) -> Any:
    """``model`` with every active :data:`MODEL_STEPS` step applied, in order; ``context``
    (e.g. a worker's ``rank``) is passed to the steps that take it. A step whose module is
    missing from this build is refused naming its setting."""
    for step in steps:
        if not step.active(config):
            continue
        module_name, _, attr = step.target.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"{step.setting} is set, but this build of servelab has no {step.target} "
                             f"to apply it ({err})") from None
        model = function(model, config, **context)
    return model


def resolve_quantization(model: Any, setting: Any) -> Any:
    """``quantization=setting`` resolved against ``model``'s layers (a
    :class:`~servelab.quantization.QuantizationPlan`, what ``pipe.config`` shows); refusals name the field."""
    from servelab.quantization.apply import plan_for_model

    return plan_for_model(model, setting)


def _probe(model: Any, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-token query ``[1, H, D]`` and a one-block key cache ``[1, block_size, Hkv, D]``
    in the model's dtype and device: what ``backend.supports`` inspects."""
    cfg = model.config
    query = torch.zeros((1, cfg.num_attention_heads, cfg.head_dim), dtype=model.dtype, device=model.device)
    key_cache = torch.zeros((1, block_size, cfg.num_key_value_heads, cfg.head_dim), dtype=model.dtype,
                            device=model.device)
    return query, key_cache


def auto_attention_backend(model: Any, block_size: int) -> str:
    """What ``attention_backend="auto"`` means for ``model``: the one rule,
    :func:`servelab.attention.backends.default_attention_backend`, given a probe of the model."""
    query, key_cache = _probe(model, block_size)
    return default_attention_backend(model.device, query=query, key_cache=key_cache,
                                     sliding_window=model.config.sliding_window,
                                     softcap=getattr(model, "attn_softcap", None))  # Gemma 2


def attach_attention(model: Any, setting: Any, block_size: int) -> str:
    """Give ``model`` the configured attention backend; returns its name."""
    name = auto_attention_backend(model, block_size) if setting == "auto" else setting
    model.attention = name  # the model's setter resolves names and checks objects
    ops = model.attention
    return name if isinstance(name, str) else getattr(ops, "name", type(ops).__name__)


def check_attention(model: Any, key_cache: torch.Tensor) -> None:
    """Fail now, with the backend's reason, rather than in the first forward."""
    ops = model.attention
    supports = getattr(ops, "supports", None)
    if supports is None:
        return
    cfg = model.config
    query_dtype = model.dtype if is_quantized_dtype(key_cache.dtype) else key_cache.dtype  # int8/fp8 pages
    query = torch.zeros((1, cfg.num_attention_heads, cfg.head_dim), dtype=query_dtype, device=key_cache.device)
    reason = supports(query, key_cache, sliding_window=cfg.sliding_window,
                      softcap=getattr(model, "attn_softcap", None))  # Gemma 2
    if reason is not None:
        name = getattr(ops, "name", type(ops).__name__)
        raise ValueError(f"attention backend {name!r} cannot run this model: {reason}")
    prepare = getattr(ops, "prepare", None)  # optional: build kernels now, not in the first step
    if prepare is not None:
        prepare(query, key_cache)


def resolve_max_model_len(config: PipelineConfig, model: Any, manager: KVCacheManagerProtocol | None = None) -> int:
    """The configured ``max_model_len``, else the manager's, else the model's
    ``max_position_embeddings``; checked against the model."""
    limit = model.config.max_position_embeddings
    value = config.scheduler.max_model_len
    if value is None:
        value = getattr(manager, "max_model_len", None) or limit
    if not 0 < value <= limit:
        raise ValueError(f"max_model_len={value!r} is invalid; valid: an int in [1, {limit}] (the model's "
                         "max_position_embeddings)")
    return value


def build_kv_cache_manager(config: PipelineConfig, model: Any, max_model_len: int) -> KVCacheManagerProtocol:
    """A :class:`~servelab.blocks.KVCacheManager` sized by the config (see
    :mod:`servelab.pipeline.sizing` for the default pool size), or, with
    ``kv_cache_groups="auto"`` and layers of different kinds, a
    :class:`~servelab.blocks.HybridKVCacheManager` (see :mod:`servelab.pipeline.hybrid`)."""
    cache = config.cache
    if wants_kv_cache_groups(cache.kv_cache_groups, model):
        return build_hybrid_kv_cache_manager(config, model, max_model_len)
    storage_dtype, kv_scale = kv_cache_storage(cache.kv_cache_dtype, cache.kv_cache_scale, model.dtype)
    spec = replace(kv_cache_spec(model, cache.block_size, storage_dtype), kv_scale=kv_scale)  # bytes: data + scales
    num_layers = model.config.num_hidden_layers
    num_blocks = cache.num_blocks
    setting, value = "num_blocks", num_blocks
    if num_blocks is None:
        num_blocks = default_num_blocks(
            spec, num_layers, max_model_len=max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
            num_speculative_tokens=config.speculative.num_speculative_tokens,
            kv_cache_memory_bytes=cache.kv_cache_memory_bytes, model=model, device=model.device)
        setting, value = ("kv_cache_memory_bytes", cache.kv_cache_memory_bytes) \
            if cache.kv_cache_memory_bytes is not None else ("num_blocks (the default pool)", num_blocks)
    check_pool_fits(num_blocks, spec.page_size_bytes * num_layers, setting=setting, value=value,
                    device=model.device)
    return KVCacheManager(spec, num_blocks, cache.enable_prefix_caching, max_model_len=max_model_len,
                          eviction_policy=cache.eviction_policy)


def check_manager(manager: KVCacheManagerProtocol, model: Any) -> None:
    """A user-built manager must implement the protocol and hold this model's KV heads and head size."""
    check_conforms(manager, KVCacheManagerProtocol, "kv_cache_manager")
    groups = getattr(manager, "groups", None)
    if groups is not None:  # a HybridKVCacheManager (any number of groups)
        check_groups_fit(groups, model)
        return
    cfg = model.config
    spec = manager.spec
    want = (cfg.num_key_value_heads, cfg.head_dim)
    if (getattr(spec, "num_kv_heads", None), getattr(spec, "head_size", None)) != want:
        raise ValueError(f"kv_cache_manager.spec {spec!r} does not fit the model: it needs "
                         f"num_kv_heads={want[0]}, head_size={want[1]}")


def scheduler_kv_cache_manager(scheduler: Any, manager: KVCacheManagerProtocol | None
                               ) -> KVCacheManagerProtocol | None:
    """The KV cache manager the pipeline uses: a ready scheduler object brings its
    own (``scheduler.kv_cache_manager``), which must then be the only one given."""
    if isinstance(scheduler, str) or isinstance(scheduler, type) or not hasattr(scheduler, "kv_cache_manager"):
        return manager
    own = scheduler.kv_cache_manager
    if manager is not None and manager is not own:
        raise ValueError("kv_cache_manager and a scheduler object with another kv_cache_manager were both given; "
                         "the scheduler's manager is the pipeline's, so pass only the scheduler")
    return own


def build_scheduler(scheduler: Any, config: SchedulerConfig, manager: KVCacheManagerProtocol,
                    policy: Any, clock: Callable[[], float]) -> SchedulerInterface:
    """``scheduler`` resolved: a registered name or a factory is built over ``manager``
    with ``config``, ``policy`` and ``clock``; an object is checked against
    :class:`~servelab.scheduling.SchedulerInterface` and used as it is."""
    if isinstance(scheduler, str):
        return get_scheduler(scheduler, config=config, kv_cache_manager=manager, policy=policy, clock=clock)
    if isinstance(scheduler, type) or (callable(scheduler) and not hasattr(scheduler, "schedule")):
        built = scheduler(config=config, kv_cache_manager=manager, policy=policy, clock=clock)
        check_conforms(built, SchedulerInterface, "scheduler")
        return built
    check_conforms(scheduler, SchedulerInterface, "scheduler")
    if getattr(scheduler, "requests", None):
        raise ValueError(f"scheduler {type(scheduler).__name__} already holds requests; give the pipeline a "
                         "fresh one")
    return scheduler


def build_drafter(config: PipelineConfig, model: Any, *, block_size: int, num_blocks: int,
                  max_num_seqs: int, vocab_size: int) -> Any:
    """The configured drafter (None without speculation); a draft model gets a
    KV pool as large as the target's plus each request's lookahead."""
    drafter = resolve_drafter(config.speculative.drafter, dtype=model.dtype, device=model.device,
                              attention=model.attention, block_size=block_size)
    bind = getattr(drafter, "bind_target", None)
    if callable(bind):  # a drafter built from the target itself ("layer_skip")
        bind(model)
    if isinstance(drafter, DraftModelDrafter):
        if drafter.vocab_size > vocab_size:
            raise ValueError(f"the draft model's vocabulary ({drafter.vocab_size}) is larger than the "
                             f"target's ({vocab_size}); they must share the tokenizer")
        if drafter.kv_caches is None:
            k = config.speculative.num_speculative_tokens
            extra = max_num_seqs * (-(-k // drafter.block_size) + 1)
            drafter.allocate(drafter.num_blocks or num_blocks + extra)
    return drafter
