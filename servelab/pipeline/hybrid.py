"""Models whose layers need different caches, in the pipeline: one KV-cache
group per kind of layer (:class:`~servelab.blocks.HybridKVCacheManager`).

Gemma 2 alternates sliding-window and full-attention layers; a Qwen2 config
with ``use_sliding_window`` / ``max_window_layers`` slides on its upper
layers. With ``kv_cache_groups="auto"`` (the default,
:class:`~servelab.config.CacheConfig`) such a model gets:

- **groups** (:func:`layer_kv_cache_specs` + ``make_kv_cache_groups``): the
  layers of each kind (full attention; each distinct window) form groups of
  equal layer count, and every group has its own block table per request.
  Sliding groups hand back the blocks that fell out of their window while
  the request runs, and need only the window's blocks for a prefix hit.
- **one shared buffer** (:func:`allocate_group_kv_caches`): a pool block id
  is one page in each of ``group_size`` layer tensors, and tensor ``j`` is
  shared by the ``j``-th layer of every group (a block belongs to one group
  at a time, so they never collide): ``num_blocks * page_size_bytes *
  group_size`` bytes whatever the mix. The default pool size
  (:func:`default_num_blocks_hybrid`) is what ``max_num_seqs`` requests can
  hold (a sliding group: the window plus one chunk, vLLM's cap), within the
  bytes the uniform cache would spend.
- **per-group step metadata** (:class:`HybridModelRunner`): one persistent
  block table per group; each step a slot mapping and a block table per
  group, handed to the model as a
  :class:`~servelab.models.GroupedAttentionMetadata` in which layer ``i``
  reads its own group's (``KVCacheGroup.layer_indices``).

Block ids cross the scheduler as a tuple of per-group lists
(:class:`~servelab.scheduling.output.NewRequestData`). A single-group model
never comes here: :class:`~servelab.pipeline.runner.ModelRunner` and the
plain :class:`~servelab.blocks.KVCacheManager` run it exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from servelab.blocks import (
    FullAttentionSpec,
    HybridKVCacheManager,
    KVCacheBuffers,
    KVCacheGroup,
    SlidingWindowSpec,
    allocate_kv_cache,
    layer_views,
    make_kv_cache_groups,
)
from servelab.blocks.kv_quant import kv_cache_storage
from servelab.blocks.layout import with_static_scales
from servelab.blocks.specs import AttentionSpec, request_blocks_cap
from servelab.models import GroupedAttentionMetadata
from servelab.models.metadata import AttentionMetadata
from servelab.pipeline.runner import CachedRequestState, ModelRunner, null_released_blocks
from servelab.pipeline.sizing import blocks_for_budget, check_pool_fits, default_kv_cache_budget
from servelab.config import PipelineConfig

__all__ = ["HybridModelRunner", "allocate_group_kv_caches", "build_hybrid_kv_cache_manager",
           "default_num_blocks_hybrid", "layer_kv_cache_specs", "wants_kv_cache_groups"]


def layer_kv_cache_specs(model: Any, block_size: int, dtype: torch.dtype, kv_scale: str | None = None) -> list[Any]:
    """Per model layer its spec: ``SlidingWindowSpec`` for a layer with a window
    (``ModelConfig.sliding_windows``), ``FullAttentionSpec`` otherwise; ``dtype`` / ``kv_scale``:
    the pages' storage (:func:`servelab.blocks.kv_quant.kv_cache_storage`)."""
    cfg = model.config
    common = dict(block_size=block_size, num_kv_heads=cfg.num_key_value_heads, head_size=cfg.head_dim, dtype=dtype,
                  kv_scale=kv_scale)
    return [FullAttentionSpec(**common) if w is None else SlidingWindowSpec(sliding_window=w, **common)
            for w in cfg.sliding_windows]


def wants_kv_cache_groups(setting: str, model: Any) -> bool:
    """True when ``kv_cache_groups=setting`` gives ``model`` several groups:
    ``"auto"`` and layers of different kinds (windows)."""
    return setting == "auto" and len(set(getattr(model.config, "sliding_windows", (None,)))) > 1


def default_num_blocks_hybrid(groups: Sequence[KVCacheGroup], num_layers: int, *, max_model_len: int,
                              max_num_seqs: int, num_speculative_tokens: int = 0,
                              max_num_batched_tokens: int | None = None, kv_cache_memory_bytes: int | None = None,
                              model: Any = None, device: torch.device | str = "cpu") -> int:
    """The default pool for ``groups`` (null block included): the uniform
    rule (:mod:`~servelab.pipeline.sizing`) with a hybrid request's real need.

    - **What the run can use**: ``max_num_seqs`` requests, each holding at
      most :func:`~servelab.blocks.specs.request_blocks_cap` blocks per
      group for ``max_model_len`` (+ drafts) tokens computed
      ``max_num_batched_tokens`` at a time (a sliding group: the window
      plus one chunk, vLLM's cap; the admission rule uses the same cap).
    - **The budget**: the bytes the uniform cache would spend
      (``kv_cache_memory_bytes`` or the default budget), as blocks of
      ``group_size`` pages.
    """
    first = groups[0].spec
    tokens = max_model_len + num_speculative_tokens
    in_flight = tokens if max_num_batched_tokens is None else max_num_batched_tokens
    per_seq = sum(request_blocks_cap(g.spec, tokens, in_flight) for g in groups)
    wanted = max_num_seqs * per_seq + 1
    given = kv_cache_memory_bytes is not None
    if kv_cache_memory_bytes is None:
        per_token = -(-first.page_size_bytes * num_layers // first.block_size)
        kv_cache_memory_bytes = default_kv_cache_budget(model, bytes_per_token=per_token, max_model_len=tokens,
                                                        device=device)
    affordable = blocks_for_budget(kv_cache_memory_bytes, group_block_bytes(groups, num_layers),
                                   given=given)
    return max(min(wanted, affordable), 2)


def group_block_bytes(groups: Sequence[KVCacheGroup], num_layers: int) -> int:
    """Bytes of one pool block of ``groups``: one page in each of ``group_size`` layers."""
    group_size = max(len(g.layer_indices) for g in groups) or -(-num_layers // len(groups))
    return groups[0].spec.page_size_bytes * group_size


def build_hybrid_kv_cache_manager(config: PipelineConfig, model: Any, max_model_len: int) -> HybridKVCacheManager:
    """A :class:`~servelab.blocks.HybridKVCacheManager` for ``model``'s layer kinds, sized by the
    resolved ``config`` (its cache, scheduling and speculative sections), checked to fit in memory."""
    cache = config.cache
    storage = kv_cache_storage(cache.kv_cache_dtype, cache.kv_cache_scale, model.dtype)
    groups = make_kv_cache_groups(layer_kv_cache_specs(model, cache.block_size, *storage))
    num_layers = model.config.num_hidden_layers
    num_blocks = cache.num_blocks
    if num_blocks is None:
        num_blocks = default_num_blocks_hybrid(
            groups, num_layers, max_model_len=max_model_len, max_num_seqs=config.scheduler.max_num_seqs,
            num_speculative_tokens=config.speculative.num_speculative_tokens,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            kv_cache_memory_bytes=cache.kv_cache_memory_bytes, model=model, device=model.device)
        setting, value = ("kv_cache_memory_bytes", cache.kv_cache_memory_bytes) \
            if cache.kv_cache_memory_bytes is not None else ("num_blocks (the default pool)", num_blocks)
    else:
        setting, value = "num_blocks", num_blocks
    check_pool_fits(num_blocks, group_block_bytes(groups, num_layers), setting=setting, value=value,
                    device=model.device)
    return HybridKVCacheManager(groups, num_blocks, cache.enable_prefix_caching, max_model_len=max_model_len,
                                eviction_policy=cache.eviction_policy)


def check_groups_fit(groups: Sequence[KVCacheGroup], model: Any) -> None:
    """Every model layer in exactly one group, whose spec has the model's KV heads and head size."""
    cfg = model.config
    owner: dict[int, int] = {}
    for g, group in enumerate(groups):
        spec = group.spec
        if (getattr(spec, "num_kv_heads", None), getattr(spec, "head_size", None)) != (
                cfg.num_key_value_heads, cfg.head_dim):
            raise ValueError(f"kv_cache_manager.groups[{g}].spec {spec!r} does not fit the model: it needs "
                             f"num_kv_heads={cfg.num_key_value_heads}, head_size={cfg.head_dim}")
        for layer in group.layer_indices:
            if layer in owner or not 0 <= layer < cfg.num_hidden_layers:
                raise ValueError(f"kv_cache_manager.groups[{g}] lists layer {layer}, which is out of range or "
                                 f"already in group {owner.get(layer)}")
            owner[layer] = g
            # A group may keep more than a layer sees (full attention for a sliding layer), never less.
            need, keep = cfg.sliding_windows[layer], getattr(spec, "sliding_window", None)
            if keep is not None and (need is None or keep < need):
                raise ValueError(f"kv_cache_manager.groups[{g}] keeps a window of {keep} tokens but layer {layer} "
                                 f"attends to {'every token' if need is None else f'{need} tokens'}")
    if len(owner) != cfg.num_hidden_layers:
        missing = sorted(set(range(cfg.num_hidden_layers)) - set(owner))
        raise ValueError(f"kv_cache_manager.groups leave layers {missing} without a group (KVCacheGroup.layer_indices)")


def allocate_group_kv_caches(groups: Sequence[KVCacheGroup], num_layers: int, num_blocks: int, *,
                             device: torch.device | str = "cpu") -> KVCacheBuffers:
    """One buffer of ``group_size`` layer tensors of ``num_blocks`` pages, viewed
    per model layer: layer ``groups[g].layer_indices[j]`` gets tensor ``j``
    through group ``g``'s spec (its ``(key_cache, value_cache)``
    ``[num_blocks, block_size_g, H, D]``). Pages must be equal (the
    hybrid manager's rule).

    Not zero-filled (the null block 0 is), as the single-group cache. A
    block a sliding group released may belong to another request meanwhile
    and hold anything (NaN, inf); a request never reads it, because
    :class:`HybridModelRunner` puts the null block in the table wherever
    the window released one (as the manager's own row does), so every
    block a table names is the request's own or the zero-filled null block.
    The backends mask the out-of-window slots of those (the torch
    reference multiplies probabilities by V: only finite values may sit
    under its mask), which the tests check by filling released blocks,
    re-owned by another request, with NaN and +-inf."""
    pages = {g.spec.page_size_bytes for g in groups}
    if len(pages) != 1:
        raise ValueError(f"KV-cache groups have pages of {sorted(pages)} bytes; one shared buffer needs equal pages")
    group_size = max(len(g.layer_indices) for g in groups)
    first = groups[0].spec
    buffers = allocate_kv_cache(first, group_size, num_blocks, device=device, zero_fill=False)
    views: list[Any] = [None] * num_layers
    for group in groups:
        same = group.spec.block_size == first.block_size
        tensors = buffers.views if same else layer_views(buffers.buffer, group.spec, group_size, num_blocks)
        for j, layer in enumerate(group.layer_indices):
            views[layer] = tensors[j]
    if any(v is None for v in views):
        raise ValueError(f"layers {[i for i, v in enumerate(views) if v is None]} are in no KV-cache group")
    static = None
    if buffers.static_scales is not None and isinstance(first, AttentionSpec):  # per model layer, not per tensor
        views, static = with_static_scales([v[:2] for v in views], first, device)
    return KVCacheBuffers(buffers.buffer, views, buffers.layout, buffers.kernel_block_size, static)


class HybridModelRunner(ModelRunner):
    """A :class:`~servelab.pipeline.runner.ModelRunner` over several KV-cache groups.

    Args:
        groups: the manager's :class:`~servelab.blocks.KVCacheGroup` objects
            (``layer_indices`` cover the model's layers).
        everything else: as ``ModelRunner``; ``block_size`` is the manager's
            (hash) block size, each group uses its own spec's.

    Block ids arrive as a tuple of per-group lists. Each group has its own
    persistent table ``block_tables[g]`` int32 ``[max_reqs, max_blocks_g]``
    (rows shared: a request has the same row in every table), and each step
    builds per group ``slot_mapping`` int64 ``[T]`` and ``block_table``
    int32 ``[B, width_g]``; ``seq_lens`` / ``query_start_loc`` are shared.
    A sliding group's released blocks become the null block (0) in its row
    before each step (the scheduler reports no releases, so the runner
    applies the manager's rule: the blocks wholly before the window of the
    step's first position, ``(c - window + 1) // block_size`` of them for a
    request at ``c`` computed tokens), so a block re-owned by another
    request is never named by this request's table.
    """

    supports_draft_trees = False  # grouped metadata carries no tree mask: trees arrive as their first branch

    def __init__(self, model: Any, kv_caches: Any, block_size: int, *, groups: Sequence[KVCacheGroup],
                 max_model_len: int, **kwargs: Any) -> None:
        super().__init__(model, kv_caches, block_size, max_model_len=max_model_len, **kwargs)
        self.groups = tuple(groups)
        self.group_block_sizes = tuple(g.spec.block_size for g in self.groups)
        layer_groups = [-1] * model.config.num_hidden_layers
        for g, group in enumerate(self.groups):
            for layer in group.layer_indices:
                layer_groups[layer] = g
        self.layer_groups = tuple(layer_groups)
        self.group_windows = tuple(g.spec.sliding_window if isinstance(g.spec, SlidingWindowSpec) else None
                                   for g in self.groups)
        rows = self.block_table.shape[0]
        self.block_tables = [torch.zeros((rows, -(-max_model_len // bs)), dtype=torch.int32)
                             for bs in self.group_block_sizes]
        self._bts = [t.numpy() for t in self.block_tables]
        self.block_table = self.block_tables[0]  # what single-table readers see
        self._bt = self._bts[0]

    def _take_row(self) -> int:
        if not self._free_rows:
            old_rows = self.block_tables[0].shape[0]
            for g, old in enumerate(self.block_tables):
                grown = torch.zeros((2 * old_rows, old.shape[1]), dtype=torch.int32)
                grown[:old_rows] = old
                self.block_tables[g], self._bts[g] = grown, grown.numpy()
            self.block_table, self._bt = self.block_tables[0], self._bts[0]
            self._free_rows = list(range(2 * old_rows - 1, old_rows - 1, -1))
        return self._free_rows.pop()

    def _set_blocks(self, state: CachedRequestState, block_ids: tuple[list[int], ...], append: bool) -> None:
        if not block_ids:  # nothing new in any group
            if not append:
                state.group_blocks = [0] * len(self.groups)
            return
        if len(block_ids) != len(self.groups):
            raise RuntimeError(f"request {state.req_id!r}: block ids {block_ids!r} are not one list per KV-cache "
                               f"group ({len(self.groups)}); is the scheduler's manager the hybrid one?")
        counts = state.group_blocks if append and state.group_blocks is not None else [0] * len(self.groups)
        for g, ids in enumerate(block_ids):
            start = counts[g]
            if start + len(ids) > self._bts[g].shape[1]:
                grown = torch.zeros((self._bts[g].shape[0], start + len(ids)), dtype=torch.int32)
                grown[:, : self._bts[g].shape[1]] = self.block_tables[g]
                self.block_tables[g], self._bts[g] = grown, grown.numpy()
            if len(ids):
                self._bts[g][state.row, start:start + len(ids)] = ids
            counts[g] = start + len(ids)
        state.group_blocks = counts
        state.num_blocks = counts[0]
        self.block_table, self._bt = self.block_tables[0], self._bts[0]

    def _detach(self, req_id: str) -> CachedRequestState | None:
        state = super()._detach(req_id)
        if state is not None and state.row < 0:
            state.group_blocks = None
        return state

    def _attention_metadata(self, rows: np.ndarray, seq: np.ndarray, positions: np.ndarray, seq_lens: np.ndarray,
                            qsl: np.ndarray) -> GroupedAttentionMetadata:
        token_rows = rows[seq]
        rows_t = torch.from_numpy(rows)
        seq_lens_t = torch.from_numpy(seq_lens).to(torch.int32)
        qsl_t = torch.from_numpy(qsl).to(torch.int32)
        longest = int(seq_lens.max())
        first = seq_lens - np.diff(qsl)  # each request's first position this step (its computed tokens)
        metas = []
        for g, (bs, window) in enumerate(zip(self.group_block_sizes, self.group_windows)):
            if window is not None:
                null_released_blocks(self._bts[g], rows, first, window, bs)
            slots = self._bts[g][token_rows, positions // bs].astype(np.int64) * bs + positions % bs
            metas.append(AttentionMetadata(slot_mapping=torch.from_numpy(slots),
                                           block_table=self.block_tables[g][rows_t][:, : -(-longest // bs)],
                                           seq_lens=seq_lens_t, query_start_loc=qsl_t))
        return GroupedAttentionMetadata(tuple(metas), self.layer_groups, self.group_block_sizes)
