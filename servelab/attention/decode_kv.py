"""Decode K/V carried from one step to the next: the ``"sdpa"`` backend without a per-step gather.

A pure decode step (every sequence adds one token) through the paged cache
costs, per layer, a gather of every sequence's whole context into a padded
batch (``[n, max_len, Hk, D]`` for K and again for V) before one attention
call: on a CPU that copy runs at memory speed and was about as long as the
attention itself (SmolLM2-135M shapes, 16 sequences of ~160 tokens: gather
100 us, SDPA 240 us, per layer). Yet consecutive decode steps of the same
sequences read the same context plus one token.

:class:`DecodeKV` keeps, per layer, the step's K and V as dense buffers in
the compute dtype (``cap`` >= the longest context, with headroom). The next
step of the *same* sequences (same rows, same block-table prefix, every
context one token longer, contexts within ``cap``) appends the one new K/V
row per sequence from the cache (inside the C kernel's call, or a gather and
a scatter per buffer) instead of gathering everything again. Outgrown
buffers are replaced by :data:`GROWTH` times larger ones that start as a
copy of the old. When some rows left (requests finished) and the others go
on in order, each layer moves its kept rows down in place; rows that join (a
prompt whose prefill ended) are gathered into the buffer rows after them when
the buffers' storage has room (fresh buffers are allocated with
:data:`ROW_HEADROOM` spare rows, never touched until a row joins). The decode
rows of a mixed step (some rows prefill) are carried the same way, the
others gathered (:func:`servelab.attention.sdpa.plan_attention`). Which rows
a step continues, and what a step does with the last one's buffers:
:mod:`servelab.attention.decode_plan`. Any other step (a reordered row, no
room) starts afresh with one gather, straight into buffer order (one row
gather per buffer over the cache viewed as ``[N * B * Hk, D]``, then K's
tiling transpose for the C kernel's layout), every position up to ``cap``
included: past a row's end it reads the row's own position 0, so no zero
fill (half the time of gathering, zero-filling, copying and tiling
separately, measured in the online benchmark's steps).

Attention over the buffers has two implementations, chosen per layer:

- **the C kernel** (:mod:`servelab.attention.cpu_decode`; float32, head size
  a multiple of 16, GQA group <= 8, a C compiler on the machine): K in tiles
  of 16 positions (``[n, Hk, cap/16, D, 16]``), V in rows
  (``[n, Hk, cap, D]``); one call per layer (each head's append, scores up
  to its length, so no buckets and no mask, softmax and values). About 1.7x
  faster than the torch formulation with the buffers cold, as they are in a
  real step (the weights stream through the cache between two reads).
- **the torch formulation** (the reference, and the fallback): K in rows
  (``[n, Hk, cap, D]``), V transposed (``[n, Hk, D, cap]``); per length
  bucket ``baddbmm`` (scores plus the length mask), ``softmax`` and ``bmm``,
  the query-head group of each KV head as the rows of one small matrix
  product (GQA without copying K/V). Cold, ``q @ K^T`` with K in rows is
  about 1.6x faster than with K transposed, and the value product as
  ``V^T @ P^T`` about 1.4x faster than ``P @ V`` (warm buffers rank them
  the other way). Measured 1.3-1.8x faster than SDPA on the same dense
  tensors.

Why carrying is safe. The buffers are copies of cache slots; they stay right
as long as those slots are not rewritten. (1) Between forwards: the model
hands a plan to the next step only if no cache tensor was modified in
between (torch's in-place version counters; see
:meth:`servelab.models.llama.LlamaForCausalLM.forward`), and only after a
forward that completed. (2) Within a carried step: every decode row writes
its own position ``len - 1``, which lies in its own last, partly filled
block; the other rows of a mixed step write their new positions into blocks
of their own too. Blocks are shared between sequences only once full and
computed (prefix caching; a prompt that hits the cache entirely still
recomputes its last token, into a block of its own), so no written slot is
in another row's carried range. (3) Across steps: only the previous step's
rows are matched, over the same block ids; a block can change owners only
after its owner left the running batch, and a row that left is never
matched again. A row whose length did not grow by exactly one (a prompt, a
chunk, a draft check) is gathered.

Padding: the buffers keep the rows sorted by length and attention runs per
length bucket (the exact least-padding split of
:func:`~servelab.attention.buckets.bucket_sequences`, cut once per carried
batch), so compute is not padded to the longest context; memory is (every
row has ``cap`` positions). A step whose padded size exceeds
:data:`MAX_PADDING` times its real size, or whose buffers would exceed
:data:`BUDGET_BYTES`, uses the gather path of :mod:`servelab.attention.sdpa`.
"""

from __future__ import annotations

import numpy as np
import torch

from servelab.attention import cpu_decode, decode_buffers
from servelab.attention.buckets import LengthBuckets
from servelab.attention.cpu_decode import tiled_index

MAX_PADDING = 4.0
"""Carry only when ``n * max_len <= MAX_PADDING * sum(lens)``: the buffers are
padded to the longest context (attention is not: it goes bucket by bucket),
so this bounds the memory spent on padding."""

BUDGET_BYTES = 512 * 2**20
"""Most bytes of dense K/V buffers one step holds over all layers; a layer
that would go past it uses the gather path (its step still computes the same
result)."""

ROW_HEADROOM = 0.25
"""Spare buffer rows at a fresh start, as a fraction of its rows (at least 4): rows that
join later (prompts whose prefill ended) are gathered into them instead of the whole
batch being regathered. Spare rows are address space only until a row joins (never
written, so their pages are never faulted in): a fresh start counts the rows it fills
against :data:`BUDGET_BYTES`, a step that reuses a storage counts all of it."""

HEADROOM = 64
"""Extra positions per buffer beyond the longest context at a fresh start, so a
batch decodes at least this many tokens before its buffers are outgrown."""

GROWTH = 1.5
"""When the same rows outgrow their buffers, the new ``cap`` is this many times
the old one (at least the longest context plus :data:`HEADROOM`; at most what
:data:`BUDGET_BYTES` allows): a decode of ``T`` tokens regrows ``O(log T)``
times, not ``T / HEADROOM`` times. Each regrowth allocates every layer's
buffers afresh, and fresh pages cost a page fault each on first touch; on the
VM this was measured on, 8-10 us per 4 KiB page inside a serving process, so
the step that regathered SmolLM2's 30 layers at batch 16 took 0.4-1.0 s, and
with a fixed headroom of 64 that came back every 64 tokens (a 300-step decode's
mean step 8% over its median)."""


class DecodeKV:
    """Dense per-layer K/V of one pure decode step's ``n`` sequences.

    Built by :func:`~servelab.attention.decode_plan.plan_decode_kv`; one instance per step, handed to the
    next step's plan. The buffers keep the sequences sorted by context length
    ("buffer rows"), so a run of similar lengths is a contiguous slice and
    attention goes bucket by bucket (:func:`~servelab.attention.buckets.bucket_sequences`
    cuts the runs, once per carried batch): a short context never reads a long
    one's padding. Tensors:

    - ``table`` int64 ``[n, nb]``, ``lens`` int64 ``[n]``: the step's
      block-table columns that hold its contexts (a copy: the caller's buffer
      may be reused) and its context lengths including this step's token, in
      the step's row order (also as numpy, ``table_host`` / ``lens_host``, for the next plan);
    - ``order`` int64 ``[n]`` (``None`` when already sorted; ``order_host`` the list): buffer
      row ``j`` holds step row ``order[j]``; ``bucketing``: the buffer-row ranges, cut on first use;
    - ``new_slots`` int64 ``[n]``: per buffer row, the cache slot of position ``len - 1``;
    - ``buffers``: per layer, keyed by ``(key_cache.data_ptr(),
      value_cache.data_ptr(), dtype)``, ``(k, v, kernel)``: for the C kernel
      (``kernel`` True) K ``[n, Hk, cap/16, D, 16]`` and V ``[n, Hk, cap, D]``,
      else K ``[n, Hk, cap, D]`` and V ``[n, Hk, D, cap]``; buffer row ``j`` holds positions ``[0, len)``
      (``[0, len - 1)`` until this step appends, when ``extends``); every
      other position is finite. (The C kernel's K is stored as ``[n * Hk, cap/16, D, 16]``,
      the same memory.)
    - ``extends``: this step appends to the last step's buffers; ``grown``: the same rows
      outgrew them, so each layer's buffers here start as a copy of the old ones at the
      larger ``cap`` (:data:`GROWTH`); ``compacted``: the old buffers reused in place, the
      kept rows moved down (some rows left) and, when ``joined``, the joining rows gathered
      into the rows after them (views of the storage's first ``n`` rows); none: a fresh
      start, one gather per layer.
    """

    def __init__(self, table: np.ndarray, lens: np.ndarray, block_size: int, cap: int, buffers: dict,
                 extends: bool, order: list[int] | None, bucketing: LengthBuckets, device: torch.device,
                 grow_from: dict | None = None, compact_from: tuple[dict, list[int]] | None = None) -> None:
        # Planned on the host: ``table`` / ``lens`` int64 numpy (what the next step's plan compares;
        # a torch op on a few dozen integers costs ~5 us of dispatch, and the ~20 of a carried
        # step's plan took ~120 us of a tiny model's ~2 ms step), each index tensor then made once.
        self.table_host, self.lens_host, self.order_host = table, lens, order
        self.block_size, self.cap = block_size, cap
        # The last step's buffers when these rows outgrew them (``grown``): each layer's new
        # buffers start as a copy of its old ones (every position but the newest), not as a
        # gather from the paged cache. A copy of the dict, emptied layer by layer.
        self.grown = grow_from is not None
        self._grow_from = dict(grow_from) if grow_from else {}
        # The last step's buffers and, per buffer row here, the old buffer row it continues,
        # when rows left or joined (``compacted``): each layer reuses them in place.
        self.compacted = compact_from is not None
        self._compact_from, self._kept = (dict(compact_from[0]), compact_from[1]) if compact_from else ({}, [])
        self.joined = self.compacted and len(self._kept) < lens.shape[0]
        self.bucketing = bucketing  # shared by the steps that carry these rows
        rows, row_lens = (table, lens) if order is None else (table[order], lens[order])
        # Ascending within each bucket (a bucket's last row is its longest).
        self.row_lens_host = row_lens.tolist()
        # Positions each kept buffer row holds before this step's append (compacted steps).
        self._kept_lens = [length - 1 for length in self.row_lens_host[:len(self._kept)]]
        self.max_len = max(self.row_lens_host)
        last = row_lens - 1
        new_slots = rows[np.arange(last.shape[0]), last // block_size] * block_size + last % block_size
        self._slot_range = (int(new_slots.min()), int(new_slots.max()))
        self.table, self.lens, self.row_table, self.row_lens, self.new_slots = (
            on_device(a, device) for a in (table, lens, rows, row_lens, new_slots))
        self.order = None if order is None else on_device(np.asarray(order, dtype=np.int64), device)
        self.inverse = None if order is None else on_device(np.argsort(order).astype(np.int64), device)
        self.buffers, self.extends = buffers, extends
        self.bytes = sum(k.numel() * k.element_size() * 2 for k, _, _ in buffers.values())
        self._masks: dict[tuple, torch.Tensor] = {}
        self._append_index: dict[tuple, tuple] = {}
        self._head_slots: dict[int, torch.Tensor] = {}

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """``(start, stop)`` buffer-row ranges, ascending lengths within each (cut on first use)."""
        return self.bucketing.ranges

    # ---- per step (shared by every layer) -------------------------------------------------

    def mask(self, dtype: torch.dtype, num_kv_heads: int, group: int) -> torch.Tensor:
        """Additive ``[n * Hk, G, max_len]`` mask in buffer-row order: 0 for positions
        ``< len``, ``-inf`` after."""
        key = (dtype, num_kv_heads, group)
        cached = self._masks.get(key)
        if cached is None:
            n = self.row_lens.shape[0]
            past_end = torch.arange(self.max_len, device=self.lens.device)[None, :] >= self.row_lens[:, None]
            mask = torch.zeros(n, self.max_len, dtype=dtype, device=self.lens.device)
            mask.masked_fill_(past_end, float("-inf"))
            cached = self._masks[key] = mask[:, None, None, :].expand(n, num_kv_heads, group, self.max_len) \
                .reshape(n * num_kv_heads, group, self.max_len)
        return cached

    def append_index(self, num_kv_heads: int, head_size: int,
                     kernel: bool) -> tuple[tuple[torch.Tensor, bool], tuple[torch.Tensor, bool]]:
        """Where this step's K and V (``[n * Hk, D]``, buffer-row order) go, each as
        ``(index, rows)``: rows of the buffer viewed as ``[-1, D]`` (``rows`` True: a
        layout with positions in rows) or elements of the flat buffer, ``(head, d)`` order."""
        cached = self._append_index.get((num_kv_heads, head_size, kernel))
        if cached is None:
            n = self.row_lens.shape[0]
            position = (self.row_lens - 1).repeat_interleave(num_kv_heads)  # [n * Hk]
            heads = torch.arange(n * num_kv_heads, device=self.lens.device)
            rows = heads * self.cap + position
            if kernel:
                cached = ((tiled_index(heads, position, self.cap, head_size), False), (rows, True))
            else:
                d = torch.arange(head_size, device=self.lens.device)
                transposed = ((heads[:, None] * head_size + d[None, :]) * self.cap + position[:, None]).flatten()
                cached = ((rows, True), (transposed, False))
            self._append_index[(num_kv_heads, head_size, kernel)] = cached
        return cached

    def context_slots(self) -> torch.Tensor:
        """int64 ``[n * max_len]``: cache slot of every position of every buffer row (past a
        row's end: its own position 0, real and finite data that the mask hides)."""
        pos = torch.arange(self.max_len, device=self.lens.device)[None, :]
        pos = torch.where(pos < self.row_lens[:, None], pos, 0)
        return (self.row_table.gather(1, pos // self.block_size) * self.block_size
                + pos % self.block_size).flatten()

    def head_slots(self, num_kv_heads: int) -> torch.Tensor:
        """int64 ``[n * Hk * cap]``: for buffer row ``(j, h)`` and position ``p < cap``, the row of
        the cache viewed as ``[N * B * Hk, D]`` that holds it (``slot * Hk + h``; past the row's
        end, its own position 0: real, finite data that the kernel's length bound hides).
        Built once per step for every layer."""
        cached = self._head_slots.get(num_kv_heads)
        if cached is None:
            pos = torch.arange(self.cap, device=self.lens.device)[None, :]
            pos = torch.where(pos < self.row_lens[:, None], pos, 0)
            slots = self.row_table.gather(1, pos // self.block_size) * self.block_size + pos % self.block_size
            heads = torch.arange(num_kv_heads, device=self.lens.device)
            cached = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
            self._head_slots[num_kv_heads] = cached
        return cached

    # ---- per layer --------------------------------------------------------------------------

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               scale: float, compute: torch.dtype) -> torch.Tensor | None:
        """Attention of this step's ``n`` queries ``[n, Hq, D]`` over the layer's carried K/V.

        ``key_cache`` / ``value_cache`` ``[N, B, Hk, D]`` already hold this
        step's K/V. Returns ``[n, Hq, D]`` in ``compute``, or ``None`` when
        this layer cannot be carried (a cache that is not a flattenable view,
        or the byte budget): the caller then takes the gather path.
        """
        if compute is torch.float32:
            out = self.attend_extending(query, key_cache, value_cache, scale)
            if out is not None:
                return out
        block_size = key_cache.shape[1]
        for cache in (key_cache, value_cache):
            if cache.shape[0] > 1 and cache.stride(0) != block_size * cache.stride(1):
                return None
        flat_k = key_cache.view(-1, *key_cache.shape[2:])
        flat_v = value_cache.view(-1, *value_cache.shape[2:])
        num_kv_heads, head_size = flat_k.shape[1:]
        layer = (key_cache.data_ptr(), value_cache.data_ptr(), compute)
        n, num_heads = query.shape[:2]
        group = num_heads // num_kv_heads
        # Extending: the last step's buffers; outgrown: new ones holding all but the newest
        # position; compacted: the last step's, without the rows that left (all three take
        # this step's row); otherwise one gather of everything.
        if self.extends:
            buffers = self.buffers.get(layer)
        elif self.compacted:
            buffers = decode_buffers.compacted(self, layer, flat_k, flat_v, compute, group)
        else:
            buffers = decode_buffers.grown(self, layer, flat_k, compute, group, BUDGET_BYTES)
        append = None  # the kernel's own append: (paged K, paged V, the new rows' slots)
        if buffers is None:
            buffers = self._gather(flat_k, flat_v, compute, group)
            if buffers is None:
                return None
        elif buffers[2] and self._direct_append(flat_k, flat_v, compute):
            append = (flat_k, flat_v, self.new_slots)
        else:
            self._append(flat_k, flat_v, buffers, compute)
        self.buffers[layer] = buffers
        q = query.to(compute)
        if self.order is not None:
            q = q.index_select(0, self.order)
        if buffers[2]:
            out = self._attend_kernel(q, buffers, scale, num_kv_heads, append)
        else:  # head h of [n * Hk, G, D] = kv head h // G
            out = self._attend_torch(q.reshape(n * num_kv_heads, group, head_size), buffers, scale)
        out = out.reshape(n, num_heads, head_size)  # the torch path's is transposed: a copy
        return out if self.inverse is None else out.index_select(0, self.inverse)

    def attend_extending(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         scale: float) -> torch.Tensor | None:
        """:meth:`attend`'s common call, in short: an extending step's layer whose carried buffers are
        the C kernel's, float32 queries ``[n, Hq, D]`` (heads and dimensions contiguous) and
        contiguous float32 caches holding every new slot, so the kernel appends the new rows
        itself. The same kernel call as the general path, without its views and re-derived sizes
        (~40 us of a layer's ~90 us of Python in a SmolLM2 batch-16 step). Returns float32
        ``[n, Hq, D]``; ``None``: take the general path (:meth:`attend`)."""
        if not self.extends:
            return None
        buffers = self.buffers.get((key_cache.data_ptr(), value_cache.data_ptr(), torch.float32))
        if (buffers is None or not buffers[2] or query.dtype is not torch.float32 or not query.is_cpu
                or key_cache.dtype is not torch.float32 or value_cache.dtype is not torch.float32
                or not (key_cache.is_contiguous() and value_cache.is_contiguous())
                or key_cache.shape != value_cache.shape or key_cache.shape[3] != query.shape[2] or query.stride(2) != 1
                or query.stride(1) != query.shape[2] or query.shape[0] != len(self.row_lens_host)):
            return None
        if not self._slots_within(key_cache.shape[0] * key_cache.shape[1]):
            return None
        n, num_heads, head_size = query.shape
        num_kv_heads = key_cache.shape[2]
        q = query if self.order is None else query.index_select(0, self.order)
        out = cpu_decode.attend_rows(q, buffers[0], buffers[1], self.row_lens, num_kv_heads, self.cap,
                                     self.max_len, scale, key_cache, value_cache, self.new_slots)
        out = out.view(n, num_heads, head_size)
        return out if self.inverse is None else out.index_select(0, self.inverse)

    def _append(self, flat_k: torch.Tensor, flat_v: torch.Tensor, buffers: tuple, compute: torch.dtype) -> None:
        """Copy every row's newest position (``len - 1``) from the flattened caches
        ``[N * B, Hk, D]`` into the layer's buffers with a gather and a scatter per buffer (the
        C kernel makes this copy itself when the caches allow it: :meth:`_direct_append`)."""
        dense_k, dense_v, kernel = buffers
        num_kv_heads, head_size = flat_k.shape[1:]
        for (index, rows), buffer, flat in zip(self.append_index(num_kv_heads, head_size, kernel),
                                               (dense_k, dense_v), (flat_k, flat_v)):
            new = flat.index_select(0, self.new_slots).to(compute)  # [n, Hk, D]
            if rows:
                buffer.view(-1, head_size).index_copy_(0, index, new.view(-1, head_size))
            else:
                buffer.view(-1).index_copy_(0, index, new.view(-1))

    def _direct_append(self, flat_k: torch.Tensor, flat_v: torch.Tensor, compute: torch.dtype) -> bool:
        """Whether the C kernel may copy the new rows straight from these caches (its ``append``
        argument) while it attends: float32,
        contiguous, every new slot inside them (checked once per step: the C side trusts it)."""
        return (flat_k.dtype == compute and flat_v.dtype == compute and flat_k.is_contiguous()
                and flat_v.is_contiguous() and self._slots_within(min(flat_k.shape[0], flat_v.shape[0])))

    def _slots_within(self, cache_rows: int) -> bool:
        """Whether every new row's slot lies in a flattened cache of ``cache_rows`` slots (the C
        kernel's append trusts it; the range is read once, when the step is planned)."""
        low, high = self._slot_range
        return low >= 0 and high < cache_rows

    def _attend_kernel(self, q: torch.Tensor, buffers: tuple, scale: float, num_kv_heads: int,
                       append: tuple | None = None) -> torch.Tensor:
        """``[n, Hq, D]`` queries -> ``[n * Hk, G, D]`` through the C kernel (one call per layer;
        ``append``: :func:`cpu_decode.attend`'s, the new rows it copies in first). The queries
        are read in place when only their rows are strided (a fused QKV slice)."""
        tiles, values = buffers[0], buffers[1]
        n, num_heads, head_size = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_size:
            q = q.contiguous()
        heads = n * num_kv_heads
        return cpu_decode.attend(q, tiles.view(heads, -1, head_size, cpu_decode.LANES),
                                 values.view(heads, self.cap, head_size), self.row_lens, num_kv_heads,
                                 self.max_len, scale, append)

    def _attend_torch(self, q: torch.Tensor, buffers: tuple, scale: float) -> torch.Tensor:
        """``[n * Hk, G, D]`` queries -> ``[n * Hk, G, D]``, bucket by bucket with torch ops."""
        heads, group, head_size = q.shape
        num_kv_heads = heads // self.row_lens.shape[0]
        keys = buffers[0].view(heads, self.cap, head_size)
        values = buffers[1].view(heads, head_size, self.cap)
        mask = self.mask(q.dtype, num_kv_heads, group)
        out = torch.empty(heads, head_size, group, dtype=q.dtype, device=q.device)  # transposed
        for start, stop in self.buckets:
            a, b, length = start * num_kv_heads, stop * num_kv_heads, self.row_lens_host[stop - 1]
            scores = torch.baddbmm(mask[a:b, :, :length], q[a:b], keys[a:b, :length].transpose(1, 2), alpha=scale)
            # out^T = V^T @ P^T: [D, len] @ [len, G] per head
            torch.bmm(values[a:b, :, :length], torch.softmax(scores, dim=-1).transpose(1, 2), out=out[a:b])
        return out.transpose(1, 2)

    def _gather_rows(self, flat_k: torch.Tensor, flat_v: torch.Tensor, dense_k: torch.Tensor, dense_v: torch.Tensor,
                     kernel: bool, start: int, compute: torch.dtype) -> None:
        """Gather buffer rows ``[start, n)`` (every position up to ``cap``: past a row's end its
        own position 0, finite) from contiguous caches viewed as ``[N * B * Hk, D]`` straight
        into their place in the layer's buffers: one row gather per buffer, plus K's tiling
        transpose for the kernel's layout, V's for the torch formulation's."""
        num_kv_heads, head_size = flat_k.shape[1:]
        rows, per_row = self.lens.shape[0] - start, num_kv_heads * self.cap
        index = self.head_slots(num_kv_heads)[start * per_row:]
        keys = flat_k.view(-1, head_size).index_select(0, index).to(compute)  # [rows * Hk * cap, D]
        values = flat_v.view(-1, head_size).index_select(0, index).to(compute)
        if kernel:  # K [n * Hk, cap/16, D, 16]; V [n, Hk, cap, D]
            dense_k[start * num_kv_heads:].copy_(
                keys.view(rows * num_kv_heads, self.cap // cpu_decode.LANES, cpu_decode.LANES, head_size)
                .transpose(2, 3))
            dense_v[start:].copy_(values.view(rows, num_kv_heads, self.cap, head_size))
        else:  # K [n, Hk, cap, D]; V [n, Hk, D, cap]
            dense_k[start:].copy_(keys.view(rows, num_kv_heads, self.cap, head_size))
            dense_v[start:].copy_(values.view(rows, num_kv_heads, self.cap, head_size).transpose(2, 3))

    def _gather(self, flat_k: torch.Tensor, flat_v: torch.Tensor, compute: torch.dtype,
                group: int) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """Fresh buffers for every row, gathered from the caches (:meth:`_gather_rows` when
        they are contiguous, into a storage with :data:`ROW_HEADROOM` spare rows); ``None``
        over the byte budget."""
        n = self.lens.shape[0]
        num_kv_heads, head_size = flat_k.shape[1:]
        kernel = cpu_decode.supports(compute, head_size, group, flat_k.device)
        element = torch.empty((), dtype=compute).element_size()
        size = n * num_kv_heads * self.cap * head_size
        if self.bytes + 2 * size * element > BUDGET_BYTES:
            return None
        self.bytes += 2 * size * element
        if flat_k.is_contiguous() and flat_v.is_contiguous():
            spare = max(4, int(n * ROW_HEADROOM))
            tiles, device = self.cap // cpu_decode.LANES, flat_k.device
            if kernel:
                shapes = ((n + spare) * num_kv_heads, tiles, head_size, cpu_decode.LANES), \
                    (n + spare, num_kv_heads, self.cap, head_size)
            else:
                shapes = (n + spare, num_kv_heads, self.cap, head_size), (n + spare, num_kv_heads, head_size, self.cap)
            dense_k, dense_v = (torch.empty(shape, dtype=compute, device=device)[: shape[0] // (n + spare) * n]
                                for shape in shapes)
            self._gather_rows(flat_k, flat_v, dense_k, dense_v, kernel, 0, compute)
            return dense_k, dense_v, kernel
        shape, device = (n, num_kv_heads, self.cap, head_size), flat_k.device
        slots = self.context_slots()
        # Positions past max_len are never read unmasked, but must be finite: zeros.
        keys = flat_k.index_select(0, slots).view(n, self.max_len, num_kv_heads, head_size).transpose(1, 2)
        values = flat_v.index_select(0, slots).view(n, self.max_len, num_kv_heads, head_size).transpose(1, 2)
        if kernel:
            rows = torch.zeros(shape, dtype=compute, device=device)
            rows[:, :, : self.max_len] = keys
            dense_k = cpu_decode.tile_keys(rows.view(-1, self.cap, head_size))
            dense_v = torch.zeros(shape, dtype=compute, device=device)
            dense_v[:, :, : self.max_len] = values
        else:
            dense_k = torch.zeros(shape, dtype=compute, device=device)
            dense_k[:, :, : self.max_len] = keys
            dense_v = torch.zeros(n, num_kv_heads, head_size, self.cap, dtype=compute, device=device)
            dense_v[..., : self.max_len] = values.transpose(2, 3)
        return dense_k, dense_v, kernel


def on_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host-planned numpy array as a tensor on ``device`` (on a CPU, the same memory)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device)
