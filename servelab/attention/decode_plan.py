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
- :func:`kept_rows`: some rows left (their requests finished), the others in the same
  order (a scheduler keeps its running order when a request ends): the step compacts
  the last buffers in place.

:func:`plan_decode_kv` decides; the buffers are built or reused per layer by
:meth:`DecodeKV.attend <servelab.attention.decode_kv.DecodeKV.attend>`. The settings
(``HEADROOM``, ``GROWTH``, ``MAX_PADDING``, ``BUDGET_BYTES``) belong to
:mod:`servelab.attention.decode_kv` and are read from there at each call.
"""

from __future__ import annotations

import torch

from servelab.attention import buckets as bucketing
from servelab.attention import decode_kv
from servelab.attention.decode_kv import DecodeKV


def same_blocks(old_table: torch.Tensor, old_lens: torch.Tensor, table: torch.Tensor, block_size: int) -> bool:
    """Whether row ``i`` of ``table`` holds the blocks that held row ``i``'s old context
    (``old_lens[i]`` positions of ``old_table``), column for column. Only those columns
    count: a table's columns past a row's last block are stale or unset."""
    held = min(old_table.shape[1], table.shape[1])
    old_blocks = -(-old_lens // block_size)
    if int(old_blocks.max()) > held:
        return False  # an old context spans columns the new table lacks
    used = torch.arange(held, device=table.device)[None, :] < old_blocks[:, None]
    return bool(((table[:, :held] == old_table[:, :held]) | ~used).all())


def continues(previous: DecodeKV, table: torch.Tensor, lens: torch.Tensor, block_size: int) -> bool:
    """Same rows as ``previous`` in the same order, each exactly one token
    longer (within its ``cap`` or not)."""
    if (previous.block_size != block_size or previous.lens.shape != lens.shape
            or not torch.equal(previous.lens + 1, lens)):
        return False
    return same_blocks(previous.table, previous.lens, table, block_size)


def kept_rows(previous: DecodeKV, table: torch.Tensor, lens_host: list[int], block_size: int) -> list[int] | None:
    """When some of ``previous``'s rows left and the others go on in the same order, each
    one token longer: per row of this step (lengths ``lens_host``), the row of ``previous``
    it continues (increasing). ``None`` otherwise (no row left, a row is new, or the order
    changed)."""
    n_old, n = previous.lens.shape[0], len(lens_host)
    if previous.block_size != block_size or not 0 < n < n_old:
        return None
    old_lens = previous.lens.tolist()
    old_first, new_first = previous.table[:, 0].tolist(), table[:, 0].tolist()
    kept, p = [], 0
    for i in range(n):  # the first candidate with the same first block and one token less
        while p < n_old and (old_first[p] != new_first[i] or old_lens[p] + 1 != lens_host[i]):
            p += 1
        if p == n_old:
            return None
        kept.append(p)
        p += 1
    # Then every block that held a kept row's previous context must be the same.
    index = torch.tensor(kept, device=previous.lens.device)
    if not same_blocks(previous.table.index_select(0, index), previous.lens.index_select(0, index), table,
                       block_size):
        return None
    return kept


def plan_decode_kv(block_table: torch.Tensor, lens: torch.Tensor, block_size: int,
                   previous: DecodeKV | None) -> DecodeKV | None:
    """The :class:`DecodeKV` of a pure decode step: ``previous``'s buffers extended (the same
    rows, one token longer), grown (those rows outgrew them) or compacted (some rows left);
    else a fresh start. ``None`` when padding would exceed
    :data:`~servelab.attention.decode_kv.MAX_PADDING`.

    Args:
        block_table: int32/int64 ``[n, max_blocks]``; lens: int64 ``[n]`` (>= 1),
        contexts including this step's token; block_size: tokens per block.
        previous: the last step's (only if nothing wrote the caches since).
    """
    n = lens.shape[0]
    if n == 0:
        return None
    lens = lens.long()  # the C kernel reads int64
    lens_host = lens.tolist()
    max_len = max(lens_host)
    if n * max_len > decode_kv.MAX_PADDING * sum(lens_host):
        return None
    num_blocks = -(-max_len // block_size)
    table = block_table[:, :num_blocks].to(torch.int64, copy=True)  # the caller may reuse its buffer
    if previous is not None and continues(previous, table, lens, block_size):
        # Every row one token longer: the sort order and the buckets still hold.
        if max_len <= previous.cap:
            return DecodeKV(table, lens, block_size, previous.cap, previous.buffers, True, previous.order,
                            previous.buckets)
        return DecodeKV(table, lens, block_size, grown_cap(previous, max_len), {}, False, previous.order,
                        previous.buckets, grow_from=previous.buffers)
    if previous is not None and max_len <= previous.cap:
        kept = kept_rows(previous, table, lens_host, block_size)
        if kept is not None:
            return _compacted(previous, table, lens, lens_host, block_size, kept)
    ranked = sorted(range(n), key=lens_host.__getitem__)
    order = None if ranked == list(range(n)) else torch.tensor(ranked, device=lens.device)
    sorted_lens = [lens_host[i] for i in ranked]
    buckets = _length_buckets(sorted_lens)
    cap = -(-(max_len + decode_kv.HEADROOM) // 16) * 16
    return DecodeKV(table, lens, block_size, cap, {}, False, order, buckets)


def _compacted(previous: DecodeKV, table: torch.Tensor, lens: torch.Tensor, lens_host: list[int],
               block_size: int, kept: list[int]) -> DecodeKV:
    """The :class:`DecodeKV` of ``previous``'s rows ``kept`` (one per row here, see
    :func:`kept_rows`): its buffer rows are the kept old ones
    in their old order, which stays sorted by length (every kept row grew by one), so only
    the buckets are cut again."""
    old_order = previous.order.tolist() if previous.order is not None else range(previous.lens.shape[0])
    new_row_of = {old: new for new, old in enumerate(kept)}  # previous step row -> this step's row
    buffer_rows = [b for b, old in enumerate(old_order) if old in new_row_of]
    ranked = [new_row_of[old_order[b]] for b in buffer_rows]  # this step's row of each buffer row
    order = None if ranked == list(range(len(kept))) else torch.tensor(ranked, device=lens.device)
    return DecodeKV(table, lens, block_size, previous.cap, {}, False, order,
                    _length_buckets([lens_host[i] for i in ranked]), compact_from=(previous.buffers, buffer_rows))


def _length_buckets(sorted_lens: list[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` buffer-row ranges of the least-padding split of ascending lengths
    (contiguous runs, since the input is sorted)."""
    runs = bucketing.bucket_sequences([1] * len(sorted_lens), sorted_lens,
                                      overhead=bucketing.DECODE_BUCKET_OVERHEAD)
    return [(run[0], run[-1] + 1) for run in runs]


def grown_cap(previous: DecodeKV, max_len: int) -> int:
    """``cap`` for rows that outgrew ``previous``'s: ``GROWTH`` times the old one, at least
    ``max_len + HEADROOM``, and no more than ``BUDGET_BYTES`` holds at the old buffers' bytes
    per position (multiples of 16; the settings of :mod:`servelab.attention.decode_kv`)."""
    need = -(-(max_len + decode_kv.HEADROOM) // 16) * 16
    grown = int(previous.cap * decode_kv.GROWTH)
    if previous.bytes:
        grown = min(grown, int(decode_kv.BUDGET_BYTES * previous.cap // previous.bytes))
    return max(need, grown // 16 * 16)
