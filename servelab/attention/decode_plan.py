"""Planning a carried decode step: which of the last step's rows it continues, and what it does
with the last step's buffers (extend, grow, compact, or start afresh).

:class:`~servelab.attention.decode_kv.DecodeKV` keeps each row's context in dense buffers
from one pure decode step to the next. Before it reuses them it must know that a row of
this step *is* a row of the last one, one token longer, over the same cache blocks:
otherwise the buffers would hold another sequence's K/V, or K/V its blocks no longer
hold. A step's rows are identified by their block tables, not by request ids (the
attention backend never sees ids): a row continues an old one when every block that
held the old context is the same block in the same column, and its length is one more.

- :func:`continues`: the same rows in the same order (the common step): the step extends
  the last buffers, or grows them (:func:`grown_cap`) when the rows outgrew them;
- :func:`matched_rows`: some rows left (their requests finished) and/or some joined (a
  prompt whose prefill just ended), the others in the same order (a scheduler keeps its
  running order): the step reuses the last buffers in place, the kept rows moved down
  and the joining ones gathered into the rows after them.

:func:`plan_decode_kv` decides; the buffers are built or reused per layer by
:meth:`DecodeKV.attend <servelab.attention.decode_kv.DecodeKV.attend>`. The settings
(``HEADROOM``, ``GROWTH``, ``MAX_PADDING``, ``BUDGET_BYTES``) belong to
:mod:`servelab.attention.decode_kv` and are read from there at each call.
"""

from __future__ import annotations

import numpy as np
import torch

from servelab.attention import decode_kv
from servelab.attention.buckets import LengthBuckets
from servelab.attention.decode_kv import DecodeKV


def same_blocks(old_table: np.ndarray, old_lens: np.ndarray, table: np.ndarray, block_size: int) -> bool:
    """Whether row ``i`` of ``table`` holds the blocks that held row ``i``'s old context
    (``old_lens[i]`` positions of ``old_table``), column for column. Only those columns
    count: a table's columns past a row's last block are stale or unset."""
    held = min(old_table.shape[1], table.shape[1])
    old_blocks = -(-old_lens // block_size)
    if int(old_blocks.max()) > held:
        return False  # an old context spans columns the new table lacks
    used = np.arange(held)[None, :] < old_blocks[:, None]
    return bool(((table[:, :held] == old_table[:, :held]) | ~used).all())


def continues(previous: DecodeKV, table: np.ndarray, lens: np.ndarray, block_size: int) -> bool:
    """Same rows as ``previous`` in the same order, each exactly one token
    longer (within its ``cap`` or not)."""
    if (previous.block_size != block_size or previous.lens_host.shape != lens.shape
            or not np.array_equal(previous.lens_host + 1, lens)):
        return False
    return same_blocks(previous.table_host, previous.lens_host, table, block_size)


def matched_rows(previous: DecodeKV, table: np.ndarray, lens_host: list[int],
                 block_size: int) -> list[int | None] | None:
    """Per row of this step (lengths ``lens_host``), the row of ``previous`` it continues (one
    token longer, over the same blocks), or ``None`` for a row that joins; the continued rows
    increase. ``None`` when no row continues one, or a candidate's blocks differ."""
    n_old, n = previous.lens_host.shape[0], len(lens_host)
    if previous.block_size != block_size or n == 0:
        return None
    old_lens = previous.lens_host.tolist()
    old_first, new_first = previous.table_host[:, 0].tolist(), table[:, 0].tolist()
    matched: list[int | None] = []
    p = 0
    for i in range(n):  # the next old row with the same first block and one token less, if any
        q = p
        while q < n_old and (old_first[q] != new_first[i] or old_lens[q] + 1 != lens_host[i]):
            q += 1
        matched.append(q if q < n_old else None)
        p = q + 1 if q < n_old else p
    kept = [(i, old) for i, old in enumerate(matched) if old is not None]
    if not kept:
        return None
    # Then every block that held a kept row's previous context must be the same.
    new_index, old_index = [i for i, _ in kept], [old for _, old in kept]
    if not same_blocks(previous.table_host[old_index], previous.lens_host[old_index], table[new_index], block_size):
        return None
    return matched


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's numpy view (no copy); another device's, copied to the host."""
    return (tensor if tensor.is_cpu else tensor.cpu()).numpy()  # one host copy per plan off a CPU


def plan_decode_kv(block_table: np.ndarray, lens: np.ndarray, block_size: int, previous: DecodeKV | None,
                   device: torch.device) -> DecodeKV | None:
    """The :class:`DecodeKV` of a step's decode rows: ``previous``'s buffers extended (the same
    rows, one token longer), grown (those rows outgrew them) or reused in place (some rows
    left, some joined); else a fresh start. ``None`` when padding would exceed
    :data:`~servelab.attention.decode_kv.MAX_PADDING`.

    Planned on the host in numpy (the decisions read a few dozen integers; torch ops on them
    cost their dispatch each), the tensors the layers read made once, on ``device``.

    Args:
        block_table: integer ``[n, max_blocks]``; lens: integer ``[n]`` (>= 1), contexts
        including this step's token (host arrays, :func:`to_host`; neither is kept);
        block_size: tokens per block (the decode rows of the step, in its order).
        previous: the last step's (only if nothing wrote the caches since).
        device: where the step's metadata, hence the plan's index tensors, live.
    """
    n = lens.shape[0]
    if n == 0:
        return None
    lens_np = lens.astype(np.int64)  # a copy, int64 as the C kernel reads it
    lens_host = lens_np.tolist()
    max_len = max(lens_host)
    if n * max_len > decode_kv.MAX_PADDING * sum(lens_host):
        return None
    num_blocks = -(-max_len // block_size)
    table = block_table[:, :num_blocks].astype(np.int64)  # a copy: the caller may reuse its buffer
    if previous is not None and continues(previous, table, lens_np, block_size):
        # Every row one token longer: the sort order and the buckets still hold.
        if max_len <= previous.cap:
            return DecodeKV(table, lens_np, block_size, previous.cap, previous.buffers, True, previous.order_host,
                            previous.bucketing, device)
        return DecodeKV(table, lens_np, block_size, grown_cap(previous, max_len), {}, False, previous.order_host,
                        previous.bucketing, device, grow_from=previous.buffers)
    if previous is not None and max_len <= previous.cap:
        matched = matched_rows(previous, table, lens_host, block_size)
        if matched is not None and (None not in matched or _kernel_only(previous)):
            return _reused(previous, table, lens_np, lens_host, block_size, matched, device)
    ranked = sorted(range(n), key=lens_host.__getitem__)
    order = None if ranked == list(range(n)) else ranked
    cap = -(-(max_len + decode_kv.HEADROOM) // 16) * 16
    return DecodeKV(table, lens_np, block_size, cap, {}, False, order,
                    LengthBuckets([lens_host[i] for i in ranked]), device)


def _reused(previous: DecodeKV, table: np.ndarray, lens: np.ndarray, lens_host: list[int],
            block_size: int, matched: list[int | None], device: torch.device) -> DecodeKV:
    """The :class:`DecodeKV` reusing ``previous``'s buffers in place (see :func:`matched_rows`):
    its first buffer rows are the kept old ones in their old buffer order (every kept row grew
    by one, so each ascending run of lengths stays one), then the joining rows, shortest first;
    the buckets are cut again, run by run."""
    old_order = previous.order_host if previous.order_host is not None else range(previous.lens_host.shape[0])
    new_row_of = {old: new for new, old in enumerate(matched) if old is not None}  # previous row -> row here
    buffer_rows = [b for b, old in enumerate(old_order) if old in new_row_of]
    ranked = [new_row_of[old_order[b]] for b in buffer_rows]  # this step's row of each buffer row
    ranked += sorted((i for i, old in enumerate(matched) if old is None), key=lens_host.__getitem__)
    order = None if ranked == list(range(len(matched))) else ranked
    return DecodeKV(table, lens, block_size, previous.cap, {}, False, order,
                    LengthBuckets([lens_host[i] for i in ranked]), device,
                    compact_from=(previous.buffers, buffer_rows))


def _kernel_only(previous: DecodeKV) -> bool:
    """Whether every layer of ``previous`` ran the C kernel, the only formulation whose bits do
    not depend on how rows are bucketed. Rows join only then: a joining row goes after the
    kept ones, so the buffer order is no longer sorted by length, and the torch formulation's
    buckets (hence its last bits) would then differ from a fresh start's."""
    return bool(previous.buffers) and all(kernel for _, _, kernel in previous.buffers.values())


def grown_cap(previous: DecodeKV, max_len: int) -> int:
    """``cap`` for rows that outgrew ``previous``'s: ``GROWTH`` times the old one, at least
    ``max_len + HEADROOM``, and no more than ``BUDGET_BYTES`` holds at the old buffers' bytes
    per position (multiples of 16; the settings of :mod:`servelab.attention.decode_kv`)."""
    need = -(-(max_len + decode_kv.HEADROOM) // 16) * 16
    grown = int(previous.cap * decode_kv.GROWTH)
    if previous.bytes:
        grown = min(grown, int(decode_kv.BUDGET_BYTES * previous.cap // previous.bytes))
    return max(need, grown // 16 * 16)
