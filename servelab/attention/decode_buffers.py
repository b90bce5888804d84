"""Reusing a carried decode step's buffers when its rows changed: grown (the same rows outgrew
their ``cap``) or compacted (some rows left, some joined).

Functions of the step's :class:`~servelab.attention.decode_kv.DecodeKV` (``kv``; not imported
here, so the two modules form no import cycle), called once
per layer by :meth:`DecodeKV.attend <servelab.attention.decode_kv.DecodeKV.attend>`; they
return the layer's ``(k, v, kernel)`` buffers, or ``None`` when the layer must be gathered
afresh. Kept apart from :mod:`servelab.attention.decode_kv` so that each file holds one job:
there, the step's plan and attention; here, moving the last step's buffers into this one's
(reading the step's private state: this module is that class's helper, not a public seam).
"""

from __future__ import annotations

from typing import Any

import torch

from servelab.attention import cpu_decode


def old_layer(previous: dict, layer: tuple, flat_k: torch.Tensor, compute: torch.dtype,
              group: int) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """The last step's buffers of ``layer``, taken out of ``previous`` (the step lets go of
    them), if this step would build them in the same layout and dtype; else ``None``."""
    old = previous.pop(layer, None)
    if old is None or old[2] != cpu_decode.supports(compute, flat_k.shape[2], group, flat_k.device) \
            or old[0].dtype != compute:
        return None
    return old


def grown(kv: Any, layer: tuple, flat_k: torch.Tensor, compute: torch.dtype, group: int,
          budget: int) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """The layer's buffers at this step's larger ``cap``, copied from its old ones (which
    hold every position but each row's newest, in the same buffer rows); past the old
    ``cap``, zeros (finite, never read unmasked). ``None`` when this is not a regrowth,
    the old layer is missing or in the other layout, or ``budget`` bytes (the step's
    :data:`~servelab.attention.decode_kv.BUDGET_BYTES`) would be exceeded."""
    old = old_layer(kv._grow_from, layer, flat_k, compute, group)
    if old is None:
        return None
    old_k, old_v, kernel = old
    num_kv_heads, head_size = flat_k.shape[1:]
    size = kv.lens.shape[0] * num_kv_heads * kv.cap * head_size  # elements per new buffer
    element = torch.empty((), dtype=compute).element_size()
    if kv.bytes + 2 * size * element > budget:
        return None
    kv.bytes += 2 * size * element
    # The axis that counts positions: K tiles [n*Hk, cap/16, D, 16] and V [n, Hk, cap, D]
    # for the kernel; K [n, Hk, cap, D] and V [n, Hk, D, cap] for the torch formulation.
    if kernel:
        return widened(old_k, 1, kv.cap // cpu_decode.LANES), widened(old_v, 2, kv.cap), True
    return widened(old_k, 2, kv.cap), widened(old_v, 3, kv.cap), False


def compacted(kv: Any, layer: tuple, flat_k: torch.Tensor, flat_v: torch.Tensor, compute: torch.dtype,
              group: int) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """The layer's last buffers reused in place: kept buffer row ``j`` moves down from old
    row ``kv._kept[j]`` (increasing, so a move never overwrites a row still to move), the
    joining rows are gathered into the rows after them, and the buffers are views of the
    storage's first ``n`` rows (no allocation, so no fresh page to fault in). Only a row's
    held positions move (``len - 1``, whole tiles for the kernel's K): what lies past them
    in the destination row is an older row's data, finite, and never read unmasked.
    ``None`` when the old layer is missing or in the other layout, or rows join and its
    storage has no room for them (or the caches cannot be gathered by rows)."""
    old = old_layer(kv._compact_from, layer, flat_k, compute, group)
    if old is None:
        return None
    old_k, old_v, kernel = old
    # Buffer rows are outermost in every layout; positions are dimension 2 (the kernel's K
    # viewed as [rows, Hk, cap/16, D * 16]: tiles of 16), or the last (the torch V).
    old_rows, n = old_v.shape[0], kv.lens.shape[0]
    k_rows = old_k.shape[0] // old_rows * n  # the kernel's K has Hk rows per buffer row
    if kv.joined and (storage_rows(old_v) < n or storage_rows(old_k) < k_rows
                        or not (flat_k.is_contiguous() and flat_v.is_contiguous())):
        return None
    if kernel:
        keys, tile = old_k.view(old_rows, -1, old_k.shape[1], old_k.shape[2] * old_k.shape[3]), cpu_decode.LANES
    else:
        keys, tile = old_k, 1
    for row, (source, held) in enumerate(zip(kv._kept, kv._kept_lens)):
        if source != row:
            keys[row, :, : -(-held // tile)].copy_(keys[source, :, : -(-held // tile)])
            if kernel:
                old_v[row, :, :held].copy_(old_v[source, :, :held])
            else:
                old_v[row, ..., :held].copy_(old_v[source, ..., :held])
    # The storage stays whole: count all of it against the budget.
    kv.bytes += old_k.untyped_storage().nbytes() + old_v.untyped_storage().nbytes()
    dense_k = old_k.as_strided((k_rows, *old_k.shape[1:]), old_k.stride())
    dense_v = old_v.as_strided((n, *old_v.shape[1:]), old_v.stride())
    if kv.joined:
        kv._gather_rows(flat_k, flat_v, dense_k, dense_v, kernel, len(kv._kept), compute)
    return dense_k, dense_v, kernel


def storage_rows(buffer: torch.Tensor) -> int:
    """How many rows (``buffer[0]``'s size) ``buffer``'s storage holds from its first row on."""
    row_bytes = buffer[0].numel() * buffer.element_size()
    return (buffer.untyped_storage().nbytes() - buffer.storage_offset() * buffer.element_size()) // row_bytes


def widened(old: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """A copy of ``old`` with dimension ``axis`` lengthened to ``size``: the old entries
    first, zeros after."""
    shape = list(old.shape)
    kept, shape[axis] = shape[axis], size
    new = torch.empty(shape, dtype=old.dtype, device=old.device)
    new.narrow(axis, 0, kept).copy_(old)
    new.narrow(axis, kept, size - kept).zero_()
    return new
