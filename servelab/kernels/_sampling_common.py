"""Pieces shared by the sampling and verification kernels."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

# Float32 -> int32 "sort key": the bits of a float32 read as int32, with the
# magnitude bits of negatives flipped, order exactly like the floats do
# (-inf < ... < -0 < +0 < ... < +inf). Searching over these integers finds a
# threshold that is exactly one of the row's values, with no rounding.
# (constexpr: compiled kernels may only read constexpr globals.)
KEY_OF_NEG_INF = tl.constexpr(-2139095041)  # float_key(-inf)
INT32_MAX = tl.constexpr(2147483647)
INT32_MIN = tl.constexpr(-2147483648)


def vocab_block_size(vocab_size: int, interpreted: bool) -> int:
    """Elements of a row processed per loop iteration.

    The interpreter pays per operation, not per element, so it gets larger
    blocks; on a GPU 1024 keeps the [BLOCK, PROBES] comparison tile in registers.
    """
    cap = 8192 if interpreted else 1024
    return max(16, min(cap, triton.next_power_of_2(vocab_size)))


@triton.jit
def float_key(x):
    """Monotone int32 key of float32 ``x`` (-0.0 and +0.0 share key 0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def exp_like_torch(x, ACCURATE: tl.constexpr):
    """``exp(x)`` in float32.

    On a GPU (``ACCURATE``) this is libdevice's ``expf``, the function torch's
    CUDA ``exp`` calls, so kernel and reference weigh tokens identically;
    ``tl.exp`` would lower to the faster ``ex2.approx`` and move near-ties.
    The interpreter has no libdevice and evaluates ``tl.exp`` with numpy.
    """
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def row_argmax(row_ptr, vocab_size, BLOCK: tl.constexpr):
    """First index of the maximum of a float row of length ``vocab_size``."""
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        values = tl.load(row_ptr + offsets, mask=offsets < vocab_size, other=float("-inf")).to(tl.float32)
        block_max = tl.max(values, axis=0)
        block_index = tl.argmax(values, axis=0).to(tl.int32) + start
        # Strictly greater: an earlier block wins ties, like torch.argmax.
        best_index = tl.where(block_max > best, block_index, best_index)
        best = tl.maximum(best, block_max)
    return best_index
