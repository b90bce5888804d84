"""Exact percentiles of a sample too large to hold: radix selection over float64 bit patterns.

Why: a million simulated requests have ~127 M inter-token gaps; holding them as one float64
array for ``np.percentile`` costs 1 GB on top of the run (the simulator's peak RSS target is
4 GB). The sample is instead read as chunks, as often as needed (a callable returns a fresh
iterator each time), and each wanted order statistic is found exactly by radix selection: a
float64 maps to a uint64 key whose order is the float order, and four passes each fix the next
16 bits of every wanted key by counting the keys that share the bits fixed so far
(``np.bincount`` over 65,536 bins). Memory: one chunk and a few 65,536-bin counts per rank.

The answer equals ``np.percentile(np.concatenate(chunks), qs)`` bit for bit (numpy's default
``"linear"`` method: the order statistics at ``floor(h)`` and ``floor(h) + 1`` for
``h = (n - 1) * q / 100``, combined by numpy's two-sided lerp), which
``tests/scheduling/test_sim_quantiles.py`` checks on random samples. NaN is not supported
(latencies are never NaN).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

__all__ = ["streaming_percentiles"]

_DIGIT_BITS = 16
_PASSES = 64 // _DIGIT_BITS
_SIGN = np.uint64(1 << 63)


def _keys(values: np.ndarray) -> np.ndarray:
    """float64 ``[n]`` -> uint64 ``[n]`` keys in the same order (negatives flipped whole,
    non-negatives with the sign bit set)."""
    bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)
    negative = (bits & _SIGN) != 0
    return np.where(negative, ~bits, bits | _SIGN)


def _value(key: int) -> float:
    bits = key & ~(1 << 63) if key & (1 << 63) else ~key & ((1 << 64) - 1)
    return float(np.array([bits], dtype=np.uint64).view(np.float64)[0])


def _order_statistics(chunks: Callable[[], Iterable[np.ndarray]], ranks: Sequence[int]) -> dict[int, float]:
    """The values of rank ``r`` (0-based, ascending) for each ``r`` in ``ranks``: ``_PASSES``
    reads of ``chunks()``."""
    prefix = {r: 0 for r in ranks}  # the key bits fixed so far (high bits first)
    below = {r: 0 for r in ranks}  # keys smaller than every key with that prefix
    for step in range(_PASSES):
        shift = 64 - _DIGIT_BITS * (step + 1)
        groups: dict[int, list[int]] = {}
        for r in ranks:
            groups.setdefault(prefix[r], []).append(r)
        counts = {p: np.zeros(1 << _DIGIT_BITS, dtype=np.int64) for p in groups}
        for chunk in chunks():
            keys = _keys(chunk)
            high = keys >> np.uint64(shift + _DIGIT_BITS) if step else None
            digit = ((keys >> np.uint64(shift)) & np.uint64((1 << _DIGIT_BITS) - 1)).astype(np.int64)
            for p in groups:
                picked = digit if high is None else digit[high == np.uint64(p >> (shift + _DIGIT_BITS))]
                counts[p] += np.bincount(picked, minlength=1 << _DIGIT_BITS)
        for p, members in groups.items():
            cumulative = np.cumsum(counts[p])
            for r in members:
                d = int(np.searchsorted(cumulative, r - below[r], side="right"))
                below[r] += int(cumulative[d - 1]) if d else 0
                prefix[r] = p | (d << shift)
    return {r: _value(prefix[r]) for r in ranks}


def _lerp(a: float, b: float, t: float) -> float:
    """numpy's ``_lerp`` (the linear method's interpolation, exact at both ends)."""
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


def streaming_percentiles(chunks: Callable[[], Iterator[np.ndarray]], qs: Sequence[float]
                          ) -> tuple[int, float, list[float]]:
    """``(count, mean, [percentile q for q in qs])`` of the concatenation of ``chunks()``.

    ``chunks``: returns a fresh iterator of float64 arrays each call (read ``1 + 4`` times).
    The mean is the sum of the chunks' ``np.sum`` over the count (so it depends on the
    chunking, not on the reads). An empty sample gives ``(0, nan, [nan, ...])``.
    """
    n, total = 0, 0.0
    for chunk in chunks():
        n += len(chunk)
        total += float(np.sum(chunk))
    if n == 0:
        return 0, float("nan"), [float("nan")] * len(qs)
    positions = [(n - 1) * (np.float64(q) / 100) for q in qs]
    ranks = sorted({min(int(math.floor(h)) + j, n - 1) for h in positions for j in (0, 1)})
    order = _order_statistics(chunks, ranks)
    out = []
    for h in positions:
        k = int(math.floor(h))
        out.append(_lerp(order[k], order[min(k + 1, n - 1)], float(h - k)))
    return n, total / n, out
