"""The pieces a :class:`~servelab.pipeline.Pipeline` is built from, resolved
from its :class:`~servelab.config.PipelineConfig`: the attention backend
(``"auto"`` resolved against the model), the KV cache manager and its pool
size, the drafter. Each function checks what it builds and says why it cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from servelab._internal.conformance import check_conforms
from servelab.attention.backends import default_attention_backend
from servelab.blocks import KVCacheManager
from servelab.blocks.interfaces import KVCacheManagerProtocol
from servelab.config import PipelineConfig
from servelab.models import kv_cache_spec
from servelab.pipeline.hybrid import build_hybrid_kv_cache_manager, check_groups_fit, wants_kv_cache_groups
from servelab.samplers.drafters import DraftModelDrafter, resolve_drafter
from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.interfaces import SchedulerInterface
from servelab.scheduling.schedulers import get_scheduler
from servelab.pipeline.sizing import default_num_blocks


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
    query = torch.zeros((1, cfg.num_attention_heads, cfg.head_dim), dtype=key_cache.dtype, device=key_cache.device)
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
        return build_hybrid_kv_cache_manager(cache, model, max_model_len,
                                             max_num_seqs=config.scheduler.max_num_seqs,
                                             num_speculative_tokens=config.speculative.num_speculative_tokens,
                                             max_num_batched_tokens=config.scheduler.max_num_batched_tokens)
    spec = kv_cache_spec(model, cache.block_size, model.dtype)
    num_blocks = cache.num_blocks
    if num_blocks is None:
        num_blocks = default_num_blocks(
            spec, model.config.num_hidden_layers, max_model_len=max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
            num_speculative_tokens=config.speculative.num_speculative_tokens,
            kv_cache_memory_bytes=cache.kv_cache_memory_bytes, model=model, device=model.device)
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
    if isinstance(drafter, DraftModelDrafter):
        if drafter.vocab_size > vocab_size:
            raise ValueError(f"the draft model's vocabulary ({drafter.vocab_size}) is larger than the "
                             f"target's ({vocab_size}); they must share the tokenizer")
        if drafter.kv_caches is None:
            k = config.speculative.num_speculative_tokens
            extra = max_num_seqs * (-(-k // drafter.block_size) + 1)
            drafter.allocate(drafter.num_blocks or num_blocks + extra)
    return drafter
