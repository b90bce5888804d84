"""Paged attention for CPUs (and any torch device) through batched
``scaled_dot_product_attention`` calls: the ``"sdpa"`` backend.

The reference (:mod:`servelab.reference.paged_attention`) loops over
sequences, which is what makes it readable and what makes it slow in a
serving loop. Here a step is split once, by :func:`plan_attention`, into a
few padded problems, and every layer reuses that plan:

- the **decode groups**: sequences with one query row (the bulk of a serving
  step). Queries are ``[n, Hq, 1, D]``; no query padding at all; contexts
  bucketed by length like the prefills (with a smaller fixed cost per bucket,
  :data:`DECODE_BUCKET_OVERHEAD`), so a 40-token context is not padded to a
  300-token neighbour. A step that is one decode bucket in row order reads
  its queries and writes its output in place (no gather, no scatter).
- the **prefill groups**: sequences with several query rows (prompts, chunks,
  draft verification), sorted by length and cut into buckets where one more
  SDPA call per layer costs less than the padding it saves
  (:func:`bucket_sequences`), each padded to its own longest query and
  context only, so a long prompt never pads the short ones (nor the decodes).
  A bucket whose sequences all start at position 0 with no window (fresh
  prompts) needs no mask at all: SDPA's ``is_causal=True`` gives the same
  rows (padding sits at the end of both axes, past every real row's
  diagonal) and lets the kernel skip the blocks above the diagonal.

With ``plan_attention(chain=True, previous=...)`` (the model passes it when
the backend declares ``"plan_chaining"``) the decode rows of a causal,
windowless step are planned instead as a
:class:`~servelab.attention.decode_kv.DecodeKV`: dense K/V buffers carried
from the previous step, extended by one position per sequence, so
consecutive decode steps of the same sequences gather nothing; in a mixed
step only the other rows (prompts, chunks) are gathered groups.

For each group the plan holds the per-token gather indices of its K/V
(``block_table[i, p // B]``, ``p % B``; positions past a sequence's end read
the sequence's own position 0, which is real data, and are masked), the query
rows to gather (padding rows repeat the sequence's last real row, so no row
is ever fully masked), and one additive float mask ``[n, 1, max_q, max_kv]``
(0 / -inf: length, causal, window) built once per step instead of once per
layer. Per layer that leaves three gathers and one SDPA call per group.

GQA goes through SDPA's ``enable_gqa=True`` (torch >= 2.5), which reads each
KV head once for its whole query-head group; older torch gets the same
result by folding the group into the query axis (``[n, Hk, G * max_q, D]``
against ``[n, Hk, max_kv, D]``). Never ``repeat_interleave``: copying K/V to
every query head cost more than all the linear layers of a decode step.

Compute dtype is float32 (float64 for float64 input). Not supported, and
refused by the backend's capability check: ``softcap`` (SDPA applies no
function to the scores) and ``return_lse``. Padding costs
``n x max_kv`` gathered K/V per group: fine on a CPU at research scale; on a
GPU use ``"triton"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from servelab._internal.attention_checks import check_paged_attention_args
from servelab._internal.tree_mask import TreeMask, check_tree_mask, tree_visible
from servelab.attention.buckets import (  # noqa: F401 - MAX_BUCKET, bucket_sequences re-exported here
    BUCKET_OVERHEAD, DECODE_BUCKET_OVERHEAD, MAX_BUCKET, bucket_sequences)
from servelab.attention import cpu_decode_quant
from servelab.attention.decode_kv import DecodeKV, on_device
from servelab.attention.decode_plan import plan_decode_kv, to_host
from servelab.blocks.kv_quant import is_static_scale

GQA_NATIVE = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
"""SDPA takes ``enable_gqa`` (torch >= 2.5); False selects the query-folding fallback."""


@dataclass
class _Group:
    """One padded SDPA problem over ``n`` sequences (all tensors on the metadata's device)."""

    q_index: torch.Tensor  # int64 [n, max_q]: query rows (padding repeats the last real row)
    kv_blocks: torch.Tensor  # int64 [n, max_kv]: cache block of each key position
    kv_offsets: torch.Tensor  # int64 [n, max_kv]: offset inside the block
    kv_slots: torch.Tensor  # int64 [n * max_kv]: block * B + offset (for a flattenable cache)
    allowed: torch.Tensor | None  # bool [n, max_q, max_kv]: length, causal and window (None if is_causal)
    out_src: torch.Tensor | None  # int64 [R]: real rows among the n * max_q (None: all are real)
    out_dst: torch.Tensor  # int64 [R]: their rows in the output
    is_causal: bool = False  # fresh prompts, no window: SDPA's is_causal=True replaces the mask
    identity: bool = False  # q_index is arange(num_tokens) with max_q 1 (a pure decode step): no gather/scatter
    _masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive mask ``[n, 1, max_q, max_kv]`` (0 where allowed, -inf elsewhere), cached
        per dtype; ``None`` for an ``is_causal`` group."""
        if self.is_causal:
            return None
        cached = self._masks.get(dtype)
        if cached is None:
            cached = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            cached.masked_fill_(~self.allowed, float("-inf"))
            cached = self._masks.setdefault(dtype, cached.unsqueeze(1))
        return cached


@dataclass
class AttentionPlan:
    """What :func:`paged_attention` needs beyond the tensors, computed once per step.

    Built by :func:`plan_attention` from the step's metadata; valid for every
    layer whose call has the same ``block_size``, ``causal`` and
    ``sliding_window``.
    """

    num_tokens: int
    num_seqs: int
    block_size: int
    causal: bool
    sliding_window: int | None
    _groups: list[_Group]  # read through ``groups`` / ``gather_groups()`` (planned on first need)
    decode_kv: DecodeKV | None = None  # the decode rows' carried K/V (``plan_attention(chain=True)``)
    tree: bool = False  # planned with a TreeMask (token trees: gathered path, never carried K/V)
    # Arguments to plan ``groups`` on first need: a decode_kv plan, or a pure decode step, whose
    # quantized pages the C kernel reads through the block table (no groups at all).
    _deferred: tuple | None = None
    # A mixed step with carried decode rows: their token rows (int64 [d], the decode_kv's row
    # order; None when every row is a decode row, in order) and the groups of the other rows.
    decode_tokens: torch.Tensor | None = None
    other_groups: list[_Group] = field(default_factory=list)
    pure_decode: bool = False  # one query row per sequence (the step's every row a decode row), no tree

    def gather_groups(self) -> list[_Group]:
        """The padded gather groups; for a ``decode_kv`` plan or a pure decode step, planned on
        first need (a layer over :data:`~servelab.attention.decode_kv.BUDGET_BYTES`, float32 pages
        without carried K/V): ~0.4 ms of a SmolLM2 batch-16 step that never needs them over int8
        pages."""
        if self._deferred is not None:
            self._groups, self._deferred = _plan_groups(*self._deferred), None
        return self._groups

    @property
    def groups(self) -> list[_Group]:
        return self.gather_groups()


def plan_attention(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                   block_size: int, causal: bool = True, sliding_window: int | None = None,
                   chain: bool = False, previous: AttentionPlan | None = None,
                   tree_mask: TreeMask | None = None) -> AttentionPlan:
    """Split a step into its decode and prefill groups (see the module docstring).

    Args:
        block_table: int32 ``[S, max_blocks]``; seq_lens: int32 ``[S]``;
        query_start_loc: int32 ``[S + 1]`` — the step's metadata.
        block_size: the cache's tokens per block.
        causal, sliding_window: as for :func:`paged_attention`.
        chain: plan a pure decode step (causal, no window) as a
            :class:`~servelab.attention.decode_kv.DecodeKV` (dense K/V carried
            to the next step) where its padding allows.
        previous: with ``chain``, the plan of the same caches' previous
            forward, which must have completed with nothing writing the
            caches since (the model checks); its carried K/V is extended when
            the step continues the same sequences.
        tree_mask: token trees at the end of the sequences (see
            :mod:`servelab._internal.tree_mask`): folded into the groups'
            masks. A tree step always takes the gathered path (its sequences
            have several query rows, so it is never a carried decode step).
    """
    device = seq_lens.device
    # Planned on the host in numpy: a plan reads a few dozen integers, and a torch op on them
    # costs its dispatch (~5 us) each; the index tensors the layers read are made once.
    lens, starts = to_host(seq_lens).astype(np.int64), to_host(query_start_loc).astype(np.int64)
    table = to_host(block_table)
    num_tokens = int(starts[-1]) if starts.size else 0
    if tree_mask is not None:
        groups = _plan_groups(table, lens, starts, block_size, causal, sliding_window, device, tree_mask)
        return AttentionPlan(num_tokens, lens.shape[0], block_size, causal, sliding_window, groups, tree=True)
    pure_decode = num_tokens == lens.shape[0] and bool((starts[1:] - starts[:-1] == 1).all())
    if chain and causal and sliding_window is None and lens.shape[0] > 0:
        plan = _plan_carried(table, lens, starts, block_size, num_tokens, previous.decode_kv if previous else None,
                             device)
        if plan is not None:
            plan.pure_decode = pure_decode
            return plan
    if pure_decode:
        return AttentionPlan(num_tokens, lens.shape[0], block_size, causal, sliding_window, [], pure_decode=True,
                             _deferred=(table, lens, starts, block_size, causal, sliding_window, device))
    groups = _plan_groups(table, lens, starts, block_size, causal, sliding_window, device)
    return AttentionPlan(num_tokens, lens.shape[0], block_size, causal, sliding_window, groups)


def _plan_carried(table: np.ndarray, lens: np.ndarray, starts: np.ndarray, block_size: int, num_tokens: int,
                  previous: DecodeKV | None, device: torch.device) -> AttentionPlan | None:
    """A causal, windowless step whose decode rows (one query row each) carry their K/V in a
    :class:`DecodeKV`; the other rows of a mixed step (prompts, chunks) are gathered groups.
    ``None`` when no decode row can be carried (then the whole step is gathered)."""
    num_seqs = lens.shape[0]
    deferred = (table, lens, starts, block_size, True, None, device)
    if num_tokens == num_seqs:  # a pure decode step: every row, in order
        carried = plan_decode_kv(table, lens, block_size, previous, device)
        return None if carried is None else AttentionPlan(num_tokens, num_seqs, block_size, True, None, [],
                                                          decode_kv=carried, _deferred=deferred)
    decoding = np.nonzero(starts[1:] - starts[:-1] == 1)[0]
    if not decoding.size:
        return None
    carried = plan_decode_kv(table[decoding], lens[decoding], block_size, previous, device)
    if carried is None:
        return None
    others = _plan_groups(table, lens, starts, block_size, True, None, device, decode_rows=False)
    return AttentionPlan(num_tokens, num_seqs, block_size, True, None, [], decode_kv=carried, _deferred=deferred,
                         decode_tokens=on_device(starts[decoding], device), other_groups=others)


def _plan_groups(table: np.ndarray, lens: np.ndarray, starts: np.ndarray, block_size: int, causal: bool,
                 sliding_window: int | None, device: torch.device, tree_mask: TreeMask | None = None, *,
                 decode_rows: bool | None = None) -> list[_Group]:
    """The padded groups of the step's rows (host arrays: ``table`` ``[S, max_blocks]``, ``lens``
    int64 ``[S]``, ``starts`` int64 ``[S + 1]``): of the decode rows (one query row) and of the
    others, or of one kind only (``decode_rows`` True / False); tensors on ``device``."""
    q_lens = starts[1:] - starts[:-1]
    groups = []
    kinds = ((True, DECODE_BUCKET_OVERHEAD), (False, BUCKET_OVERHEAD))
    for decoding, costs in kinds if decode_rows is None else [kinds[0 if decode_rows else 1]]:
        members = np.nonzero(q_lens == 1 if decoding else q_lens > 1)[0]
        if not members.size:
            continue
        q_host, kv_host = q_lens[members].tolist(), lens[members].tolist()
        for bucket in bucket_sequences(q_host, kv_host, overhead=costs):
            index = members if len(bucket) == len(q_host) else members[bucket]
            fresh = (not decoding and causal and sliding_window is None and tree_mask is None
                     and all(q_host[i] == kv_host[i] for i in bucket))
            tree = None if tree_mask is None else (tree_mask.ancestors,
                                                   tree_mask.tree_lens.long()[on_device(index, device)])
            groups.append(_plan_group(table[index].astype(np.int64, copy=False), lens[index], starts[index],
                                      q_lens[index], block_size, causal, sliding_window, device, fresh, tree))
    # Every sequence decodes one token in one bucket (the bulk of a serving
    # loop): the queries are the rows in order, the output needs no scatter.
    # (One group of every row, one query row each, holds them in row order: its queries are starts[:-1].)
    if len(groups) == 1 and groups[0].q_index.shape == (lens.shape[0], 1):
        groups[0].identity = bool(np.array_equal(starts[:-1], np.arange(lens.shape[0])))
    return groups


def _plan_group(table: np.ndarray, lens: np.ndarray, starts: np.ndarray, q_lens: np.ndarray, block_size: int,
                causal: bool, window: int | None, device: torch.device, fresh: bool = False,
                tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> _Group:
    """One bucket's gather indices and mask (from host arrays, int64); ``tree``: (ancestors int64
    ``[T]``, the bucket's tree lengths int64 ``[n]``) of a :class:`TreeMask`."""
    max_q, max_kv = int(q_lens.max()), int(lens.max())
    kv_pos = np.arange(max_kv)
    in_seq = kv_pos[None, :] < lens[:, None]  # [n, max_kv]
    safe_pos = np.where(in_seq, kv_pos[None, :], 0)  # past the end: the sequence's own position 0
    kv_blocks = np.take_along_axis(table, safe_pos // block_size, axis=1)
    t = np.minimum(np.arange(max_q)[None, :], q_lens[:, None] - 1)  # [n, max_q]
    q_index = starts[:, None] + t
    q_pos = (lens - q_lens)[:, None] + t  # absolute position of each query row
    is_causal = fresh and max_q == max_kv
    allowed = None  # fresh prompts: SDPA's own causal mask; no [n, max_q, max_kv] tensor to build
    if not is_causal:
        rule = np.broadcast_to(in_seq[:, None, :], (lens.shape[0], max_q, max_kv))
        if causal:
            rule = rule & (kv_pos[None, None, :] <= q_pos[:, :, None])
        if window is not None:
            rule = rule & (q_pos[:, :, None] - kv_pos[None, None, :] < window)
        allowed = on_device(rule, device)
        if tree is not None:
            ancestors = tree[0].to(device)[on_device(q_index, device)]  # [n, max_q]
            allowed = allowed & tree_visible(ancestors, on_device(kv_pos, device)[None, :],
                                             on_device(lens, device) - tree[1])
        allowed = allowed.contiguous()
    if max_q == 1:
        out_src, out_dst = None, on_device(q_index[:, 0], device)
    else:
        real = (np.arange(max_q)[None, :] < q_lens[:, None]).flatten()
        src = np.nonzero(real)[0]
        out_src, out_dst = on_device(src, device), on_device(q_index.flatten()[src], device)
    kv_offsets = safe_pos % block_size
    kv_slots = (kv_blocks * block_size + kv_offsets).flatten()
    return _Group(on_device(q_index, device), on_device(kv_blocks, device), on_device(kv_offsets, device),
                  on_device(kv_slots, device), allowed, out_src, out_dst, is_causal=is_causal)


def _check_plan(plan: AttentionPlan, num_tokens: int, num_seqs: int, block_size: int, causal: bool,
                sliding_window: int | None, tree: bool = False) -> None:
    got = (plan.num_tokens, plan.num_seqs, plan.block_size, plan.causal, plan.sliding_window, plan.tree)
    want = (num_tokens, num_seqs, block_size, causal, sliding_window, tree)
    if got != want:
        raise ValueError(f"plan was made for (num_tokens, num_seqs, block_size, causal, sliding_window, tree)={got}, "
                         f"but this call has {want}; call plan_attention with this step's metadata")


def _gather(cache: torch.Tensor, group: _Group) -> torch.Tensor:
    """The group's K or V ``[n, max_kv, Hk, D]`` from a cache ``[N, B, Hk, D]`` (float8 gathered as
    its bytes: CPU torch has no float8 ``index_select``)."""
    if cache.dtype.is_floating_point and cache.element_size() == 1:
        return _gather(cache.view(torch.uint8), group).view(cache.dtype)
    num_blocks, block_size = cache.shape[:2]
    if num_blocks < 2 or cache.stride(0) == block_size * cache.stride(1):
        # One index_select over the flattened (view of the) cache: ~2.5x faster
        # on a CPU than advanced indexing with two index tensors.
        rows = cache.flatten(0, 1).index_select(0, group.kv_slots)
        return rows.view(*group.kv_blocks.shape, *cache.shape[2:])
    return cache[group.kv_blocks, group.kv_offsets]


def _gather_scale(scale: torch.Tensor, group: _Group) -> torch.Tensor:
    """The group's scales ``[n, max_kv, Hk]`` from ``[N, B, Hk]`` (a static scale: its one row)."""
    if is_static_scale(scale):
        return scale[0, 0].expand(*group.kv_blocks.shape, scale.shape[2])
    return _gather(scale, group)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """q ``[n, max_q, Hq, D]``, k/v ``[n, max_kv, Hk, D]``, mask ``[n, 1, max_q, max_kv]``
    (``None``: causal with ``max_q == max_kv``) -> ``[n, max_q, Hq, D]``."""
    n, max_q, num_q_heads, head_size = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if group == 1 or GQA_NATIVE:
        extra = {"enable_gqa": True} if group > 1 else {}
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                             is_causal=mask is None, **extra)
        return out.transpose(1, 2)
    if mask is None:  # the fallback folds queries, so the diagonal needs an explicit mask
        max_kv = k.shape[2]
        mask = torch.zeros(max_q, max_kv, dtype=q.dtype, device=q.device)
        mask.masked_fill_(torch.ones(max_q, max_kv, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        mask = mask.expand(n, 1, max_q, max_kv)
    # Fold each KV head's query-head group into the query axis: [n, Hk, G * max_q, D].
    folded = q.view(n, max_q, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
    folded = folded.reshape(n, num_kv_heads, group * max_q, head_size)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask.repeat(1, 1, group, 1), scale=scale)
    out = out.view(n, num_kv_heads, group, max_q, head_size).permute(0, 3, 1, 2, 4)
    return out.reshape(n, max_q, num_q_heads, head_size)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    check_inputs: bool = True,
    plan: AttentionPlan | None = None,
    tree_mask: TreeMask | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same signature and semantics as :func:`servelab.reference.paged_attention`
    (query ``[T, Hq, D]``, caches ``[N, B, Hk, D]``, int32 metadata; returns
    ``[T, Hq, D]`` in the query's dtype), without ``softcap`` and
    ``return_lse``; ``plan`` is :func:`plan_attention` of this step's metadata
    (made here when ``None``). With a ``plan`` and ``check_inputs=False`` no
    argument is checked at all (the caller checked an identical call). ``tree_mask``: token
    trees, as in the reference (the plan must have been made with it). ``k_scale`` / ``v_scale``:
    a quantized cache's scales (:mod:`servelab.blocks.kv_quant`); each group's gathered K/V is
    dequantized in the compute dtype (a per-step temporary; carried decode K/V is not used)."""
    if softcap is not None:
        raise ValueError(f"softcap={softcap!r}: the sdpa backend cannot cap scores; use 'torch' or 'triton'")
    if return_lse:
        raise ValueError("return_lse=True: the sdpa backend does not compute the log-sum-exp; use 'torch' or 'triton'")
    block_size = key_cache.shape[1]
    if plan is not None and not check_inputs:
        # The hot path: the model checked this step's first layer (same
        # shapes, dtypes and metadata for every layer) and planned once.
        scale = query.shape[-1] ** -0.5 if scale is None else scale
    else:
        scale = check_paged_attention_args(
            query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
            scale=scale, causal=causal, sliding_window=sliding_window, softcap=None,
            out=out, num_splits=num_splits, check_values=check_inputs, k_scale=k_scale, v_scale=v_scale,
        )
        if tree_mask is not None:
            check_tree_mask(tree_mask, query.shape[0], seq_lens, query_start_loc, sliding_window=sliding_window,
                            check_values=check_inputs)
    if plan is None:
        plan = plan_attention(block_table, seq_lens, query_start_loc, block_size=block_size, causal=causal,
                              sliding_window=sliding_window, tree_mask=tree_mask)
    else:
        _check_plan(plan, query.shape[0], seq_lens.shape[0], block_size, causal, sliding_window,
                    tree_mask is not None)
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    if k_scale is not None and v_scale is not None:
        return _attend_quantized_pages(plan, query, key_cache, value_cache, block_table, seq_lens, scale, compute,
                                       out, sliding_window, tree_mask is not None, k_scale, v_scale)
    if plan.decode_kv is not None:
        decoding = query if plan.decode_tokens is None else query.index_select(0, plan.decode_tokens)
        attn = plan.decode_kv.attend(decoding, key_cache, value_cache, scale, compute)
        if attn is not None:
            attn = attn.to(query.dtype)
            if plan.decode_tokens is None:
                return attn if out is None else out.copy_(attn)
            result = out if out is not None else torch.empty_like(query)
            result.index_copy_(0, plan.decode_tokens, attn)
            return _attend_groups(plan.other_groups, query, key_cache, value_cache, scale, compute, result)
    groups = plan.gather_groups()
    if len(groups) == 1 and groups[0].identity:
        g = groups[0]
        q = query.unsqueeze(1).to(compute)  # [T, 1, Hq, D]: sequence i is row i
        attn = _attend(q, _gather(key_cache, g).to(compute), _gather(value_cache, g).to(compute),
                       g.mask(compute), scale)
        attn = attn.reshape(query.shape).to(query.dtype)
        if out is None:
            return attn
        return out.copy_(attn)
    result = out if out is not None else torch.empty_like(query)
    return _attend_groups(groups, query, key_cache, value_cache, scale, compute, result)


def _attend_quantized_pages(plan: AttentionPlan, query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, compute: torch.dtype,
                            out: torch.Tensor | None, sliding_window: int | None, tree: bool,
                            k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """:func:`paged_attention` over quantized pages: a pure decode step in the C kernel, which reads the
    int8/fp8 pages themselves; anything else gathered per group and dequantized in ``compute``."""
    if plan.pure_decode and not tree and cpu_decode_quant.usable(query, key_cache, value_cache):
        decoded = cpu_decode_quant.paged_decode(query, key_cache, value_cache, k_scale, v_scale, block_table,
                                                seq_lens, scale, sliding_window)
        return decoded if out is None else out.copy_(decoded)
    result = out if out is not None else torch.empty_like(query)
    return _attend_groups(plan.gather_groups(), query, key_cache, value_cache, scale, compute, result,
                          (k_scale, v_scale))


def _attend_groups(groups: list[_Group], query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   scale: float, compute: torch.dtype, result: torch.Tensor,
                   kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Each group's gather and SDPA call, its rows written into ``result`` ``[T, Hq, D]``;
    ``kv_scales``: a quantized cache's ``(k_scale, v_scale)`` ``[N, B, Hk]``."""
    for g in groups:
        q = query.index_select(0, g.q_index.flatten()).view(*g.q_index.shape, *query.shape[1:]).to(compute)
        k = _gather(key_cache, g).to(compute)  # [n, max_kv, Hk, D]
        v = _gather(value_cache, g).to(compute)
        if kv_scales is not None:  # dequantize: data * scale of its (token, head)
            k.mul_(_gather_scale(kv_scales[0], g).to(compute).unsqueeze(-1))
            v.mul_(_gather_scale(kv_scales[1], g).to(compute).unsqueeze(-1))
        attn = _attend(q, k, v, g.mask(compute), scale)
        rows = attn.reshape(-1, *attn.shape[2:])
        if g.out_src is not None:
            rows = rows[g.out_src]
        result.index_copy_(0, g.out_dst, rows.to(result.dtype))
    return result
