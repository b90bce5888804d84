"""Splitting a step's sequences into padded SDPA problems of least cost.

Shared by the SDPA backend's per-step plan (:mod:`servelab.attention.sdpa`) and the
carried decode K/V (:mod:`servelab.attention.decode_kv`), which buckets decode
contexts the same way; kept apart so neither imports the other.
"""

from __future__ import annotations

import math

__all__ = ["BUCKET_OVERHEAD", "DECODE_BUCKET_OVERHEAD", "MAX_BUCKET", "LengthBuckets", "bucket_sequences"]


BUCKET_OVERHEAD = 4096
"""Cost of one more prefill SDPA problem per layer (gathers, mask, call,
scatter), in padded (query row, key) pairs: :func:`bucket_sequences` splits
a bucket only where that saves more pairs than this. Measured on a CPU, one
thread: a group's fixed cost per layer is ~100 us, about the time SDPA spends
on this many pairs at SmolLM2's 9 x 64 query width."""

DECODE_BUCKET_OVERHEAD = 512
"""The same for decode buckets. A decode pair costs more (its K/V row is
gathered for one query row only), so a padded key is worth more."""

MAX_BUCKET = 64
"""Longest run of sequences :func:`bucket_sequences` considers for one bucket
(bounds its quadratic search; ``O(64 n)`` host work per step)."""


def bucket_sequences(q_lens: list[int], kv_lens: list[int], *,
                    overhead: int = BUCKET_OVERHEAD) -> list[list[int]]:
    """Partition sequences into padded SDPA problems of least total cost.

    Sequences are sorted by context length (query length breaking ties) and
    cut into contiguous runs; a run of ``n`` sequences costs ``overhead +
    n * max(q_lens) * max(kv_lens)`` padded score pairs. An exact dynamic
    program over cut points (runs of at most :data:`MAX_BUCKET`), which stops
    lengthening a run once its own cost alone reaches the best found (costs
    are non-negative, so no longer run can win).

    Args:
        q_lens, kv_lens: per-sequence query rows and context length (``kv >= q``).
        overhead: fixed cost of one more bucket, in pairs.

    Returns:
        Buckets of indices into the inputs, shortest first; every index once.
    """
    order = sorted(range(len(q_lens)), key=lambda i: (kv_lens[i], q_lens[i]))
    n = len(order)
    qs = [q_lens[i] for i in order]
    best: list[float] = [0.0] + [math.inf] * n  # best[j]: least cost of order[:j]
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        max_q, max_kv = 0, kv_lens[order[j - 1]]  # sorted: the run's last sequence has the longest context
        best_j, cut_j = math.inf, 0
        for i in range(j - 1, max(-1, j - 1 - MAX_BUCKET), -1):
            q = qs[i]
            if q > max_q:
                max_q = q
            run = overhead + (j - i) * max_q * max_kv
            if run >= best_j:  # every longer run costs at least this much more than best[i] >= 0:
                break          # none can do better (the same cuts as the full search)
            cost = best[i] + run
            if cost < best_j:
                best_j, cut_j = cost, i
        best[j], cut[j] = best_j, cut_j
    buckets, j = [], n
    while j > 0:
        buckets.append(order[cut[j]:j])
        j = cut[j]
    return buckets[::-1]


class LengthBuckets:
    """The ``(start, stop)`` buffer-row ranges of carried decode rows whose context lengths, in
    buffer order, are ``lens``: each maximal ascending run split the least-padding way
    (:func:`bucket_sequences`, decode costs), so a bucket's last row is its longest.

    Cut on first use, once (:attr:`ranges`): only the torch formulation of
    :class:`~servelab.attention.decode_kv.DecodeKV` reads them (the C kernel goes head by head,
    each to its own length), and the steps that carry a batch share this object, so they keep
    the cut of the lengths it started with, whichever step first needs it. That is the cut the
    first step would have made: each carried step adds one to every length, and a run of ``n``
    rows costs ``overhead + n * (its longest)``, so every partition's cost grows by the same
    (the row count) and the cheapest stays the cheapest. (Cutting every plan took ~12 us per
    run, ~70 us of a mixed step's plan with six runs.)"""

    __slots__ = ("lens", "_ranges")

    def __init__(self, lens: list[int]) -> None:
        self.lens = lens
        self._ranges: list[tuple[int, int]] | None = None

    @property
    def ranges(self) -> list[tuple[int, int]]:
        if self._ranges is None:
            ranges, start, lens = [], 0, self.lens
            for stop in range(1, len(lens) + 1):
                if stop == len(lens) or lens[stop] < lens[stop - 1]:
                    runs = bucket_sequences([1] * (stop - start), lens[start:stop], overhead=DECODE_BUCKET_OVERHEAD)
                    ranges += [(start + run[0], start + run[-1] + 1) for run in runs]
                    start = stop
            self._ranges = ranges
        return self._ranges
