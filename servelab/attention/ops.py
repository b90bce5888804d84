"""Vectorised torch versions of the KV-cache write and the attention-state merge.

The defaults of :class:`~servelab.attention.backends.AttentionBackend` (so
the ``"sdpa"`` backend and any researcher's backend get them for free). Same
signatures, checks and results as the references
(:mod:`servelab.reference.reshape_and_cache`,
:mod:`servelab.reference.merge_attn_states`), which the tests hold them to;
the difference is the hot path: with ``check_inputs=False`` and no skipped
slot the write is two ``index_copy_`` calls.
"""

from __future__ import annotations

import torch

from servelab._internal.attention_checks import check_merge_attn_states_args, check_reshape_and_cache_args


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_inputs: bool = True,
) -> None:
    """Scatter ``key`` / ``value`` ``[T, Hk, D]`` into the caches ``[N, B, Hk, D]``
    at ``slot_mapping`` int32/int64 ``[n <= T]`` (``-1`` skips a row), in place.

    ``check_inputs=False`` skips every check, shapes included (unlike the
    reference): the model passes it for layers after the first, whose
    identical call was checked."""
    if check_inputs:
        check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping, check_values=True)
    if slot_mapping.shape[0] == 0:
        return
    write_prepared(key, value, key_cache, value_cache, *prepare_slots(slot_mapping))


def write_prepared(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slots: torch.Tensor, rows: torch.Tensor | None) -> None:
    """The write of :func:`reshape_and_cache` with the slots of :func:`prepare_slots` (no checks):
    the model prepares them once per step and writes every layer with this."""
    if rows is None:
        key, value = key[: slots.shape[0]], value[: slots.shape[0]]
    else:  # padding rows skipped
        key, value = key[rows], value[rows]
    for src, cache in ((key, key_cache), (value, value_cache)):
        num_blocks, block_size = cache.shape[:2]
        if num_blocks < 2 or cache.stride(0) == block_size * cache.stride(1):
            # A flattenable cache (every layout but "block_outermost"): one
            # index_copy_ over [N * B, Hk, D] rows, no block/offset split.
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, src)  # view: never a silent copy
        else:
            cache.index_put_((slots // block_size, slots % block_size), src)


def prepare_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """int64 slots without the ``-1`` rows, and the kept row indices (``None``: all kept)."""
    slots, rows = slot_mapping.long(), None
    if bool((slots < 0).any()):  # padding rows (one host read; free for CPU tensors)
        rows = torch.nonzero(slots >= 0).flatten()
        slots = slots[rows]
    return slots, rows


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions ``[T, H, D]`` by their LSEs ``[T, H]`` (float32,
    float64 with float64 outputs; ``-inf`` = empty partial). Returns
    ``(out, lse)``; two empty partials give 0 and ``-inf``, never NaN."""
    check_merge_attn_states_args(out_a, lse_a, out_b, lse_b, out=out, check_values=check_inputs)
    compute = torch.float64 if out_a.dtype == torch.float64 else torch.float32
    lse_a, lse_b = lse_a.to(compute), lse_b.to(compute)
    peak = torch.maximum(lse_a, lse_b)
    peak = torch.where(torch.isinf(peak), 0.0, peak)  # both empty: exp(-inf - 0) = 0, not NaN
    weight_a, weight_b = torch.exp(lse_a - peak), torch.exp(lse_b - peak)
    total = weight_a + weight_b
    # An empty partial's output is never read (it may hold garbage).
    part_a = torch.where(weight_a[..., None] > 0, weight_a[..., None] * out_a.to(compute), 0.0)
    part_b = torch.where(weight_b[..., None] > 0, weight_b[..., None] * out_b.to(compute), 0.0)
    merged = (part_a + part_b) / torch.where(total > 0, total, 1.0)[..., None]
    if out is None:
        out = torch.empty_like(out_a)
    out.copy_(merged)
    return out, peak + torch.log(total)
