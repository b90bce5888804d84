"""Triton min-p / top-k / top-p filtering and sampling, without a sort.

Same semantics and signature as :func:`servelab.reference.sampling.top_k_top_p_sample`
(read its module docstring for the exact definition of each filter).

How it avoids sorting: every filter keeps an upper set ``{v : key(l_v) >= T}``
of the row in logit order, where ``key`` maps float32 to int32 preserving
order. So the kernel only needs thresholds, and finds each one exactly by a
search over the 2**32 integer keys (one program per row):

- pass 1: max logit, smallest and largest key;
- min-p: ``T_minp`` = smallest key whose ``exp(l - max) >= min_p`` (one pass);
- top-k: the largest ``t`` with ``count(key >= t) >= k`` is exactly the k-th
  largest value (ties kept);
- top-p: the smallest ``t`` with ``mass(key > t) < top_p * Z`` over the
  tokens still kept is exactly the cut of the sorted definition.

Each search probes 16 thresholds per pass over the row (a [BLOCK, 16]
comparison tile), so it narrows the range 17x per pass: at most 8-9 passes
per search instead of 32 for plain bisection, each a streaming read of the
row. Cost per row: about ``3 + 9 * (top-k) + 9 * (top-p)`` reads of ``vocab``
floats, no extra memory. The final pass samples by exponential race against
the given noise, which is what makes the kernel and the reference pick the
same token for the same noise. Rows that disable a filter skip its passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelab.kernels._sampling_common import (
    INT32_MAX,
    INT32_MIN,
    KEY_OF_NEG_INF,
    exp_like_torch,
    float_key,
    vocab_block_size,
)
from servelab.kernels._triton_utils import is_interpreted, require_launchable
from servelab._internal.sampling_checks import check_sampling_inputs

NUM_PROBES = 16


@triton.jit
def _largest_key_with_count(row_ptr, vocab_size, lo, hi, k, BLOCK: tl.constexpr, PROBES: tl.constexpr):
    """Largest t in [lo, hi] with count(key >= t) >= k, given that t = lo qualifies."""
    probe_ids = tl.arange(0, PROBES)
    while lo < hi:
        span = hi - lo + 1
        probes = lo + ((probe_ids + 1).to(tl.int64) * span) // (PROBES + 1)
        probes32 = probes.to(tl.int32)
        counts = tl.zeros([PROBES], dtype=tl.int32)
        for start in range(0, vocab_size, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            in_row = offsets < vocab_size
            keys = float_key(tl.load(row_ptr + offsets, mask=in_row, other=float("-inf")).to(tl.float32))
            hits = (keys[:, None] >= probes32[None, :]) & in_row[:, None]
            counts += tl.sum(hits.to(tl.int32), axis=0)
        # count(key >= t) only falls as t grows: the qualifying probes are a prefix.
        num_qualifying = tl.sum((counts >= k).to(tl.int32), axis=0)
        last_good = tl.sum(tl.where(probe_ids == num_qualifying - 1, probes, 0), axis=0)
        first_bad = tl.sum(tl.where(probe_ids == num_qualifying, probes, 0), axis=0)
        lo = tl.where(num_qualifying > 0, last_good, lo)
        hi = tl.where(num_qualifying < PROBES, first_bad - 1, hi)
    return lo


@triton.jit
def _smallest_key_with_mass_below(
    row_ptr, vocab_size, lo, hi, max_logit, budget, BLOCK: tl.constexpr, PROBES: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
):
    """Smallest t in [lo, hi] with sum(exp(l - max) over key > t) < budget, given t = hi qualifies."""
    probe_ids = tl.arange(0, PROBES)
    while lo < hi:
        span = hi - lo + 1
        probes = lo + (probe_ids.to(tl.int64) * span) // PROBES
        probes32 = probes.to(tl.int32)
        masses = tl.zeros([PROBES], dtype=tl.float32)
        for start in range(0, vocab_size, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            in_row = offsets < vocab_size
            logits = tl.load(row_ptr + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
            keys = float_key(logits)
            weights = exp_like_torch(logits - max_logit, ACCURATE_EXP)
            above = (keys[:, None] > probes32[None, :]) & in_row[:, None]
            masses += tl.sum(tl.where(above, weights[:, None], 0.0), axis=0)
        # mass above t only falls as t grows: the failing probes are a prefix.
        num_failing = PROBES - tl.sum((masses < budget).to(tl.int32), axis=0)
        first_good = tl.sum(tl.where(probe_ids == num_failing, probes, 0), axis=0)
        last_bad = tl.sum(tl.where(probe_ids == num_failing - 1, probes, 0), axis=0)
        hi = tl.where(num_failing < PROBES, first_good, hi)
        lo = tl.where(num_failing > 0, last_bad + 1, lo)
    return lo


@triton.jit
def _top_k_top_p_sample_kernel(
    logits_ptr,
    logits_row_stride,
    noise_ptr,
    noise_row_stride,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    out_ptr,
    vocab_size,
    USE_TOP_K: tl.constexpr,
    USE_TOP_P: tl.constexpr,
    USE_MIN_P: tl.constexpr,
    BLOCK: tl.constexpr,
    PROBES: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    noise_row_ptr = noise_ptr + row * noise_row_stride

    max_logit = tl.full((), float("-inf"), tl.float32)
    min_key = tl.full((), INT32_MAX, tl.int32)
    max_key = tl.full((), INT32_MIN, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        in_row = offsets < vocab_size
        logits = tl.load(row_ptr + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
        keys = float_key(logits)
        max_logit = tl.maximum(max_logit, tl.max(logits, axis=0))
        min_key = tl.minimum(min_key, tl.min(tl.where(in_row, keys, INT32_MAX), axis=0))
        max_key = tl.maximum(max_key, tl.max(tl.where(in_row, keys, INT32_MIN), axis=0))

    # Kept set so far: key >= threshold. -inf logits are never kept.
    threshold = tl.maximum(min_key, KEY_OF_NEG_INF + 1)

    if USE_MIN_P:
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        if min_p > 0.0:
            min_p_key = tl.full((), INT32_MAX, tl.int32)
            for start in range(0, vocab_size, BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                in_row = offsets < vocab_size
                logits = tl.load(row_ptr + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
                passes = in_row & (exp_like_torch(logits - max_logit, ACCURATE_EXP) >= min_p)
                min_p_key = tl.minimum(min_p_key, tl.min(tl.where(passes, float_key(logits), INT32_MAX), axis=0))
            threshold = tl.maximum(threshold, min_p_key)

    if USE_TOP_K:
        k = tl.load(top_k_ptr + row).to(tl.int32)
        if (k > 0) & (k < vocab_size):
            kth_key = _largest_key_with_count(
                row_ptr, vocab_size, min_key.to(tl.int64), max_key.to(tl.int64), k, BLOCK, PROBES
            )
            threshold = tl.maximum(threshold, kth_key.to(tl.int32))

    if USE_TOP_P:
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        if top_p < 1.0:
            kept_mass = tl.zeros((), tl.float32)
            for start in range(0, vocab_size, BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                in_row = offsets < vocab_size
                logits = tl.load(row_ptr + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
                kept = in_row & (float_key(logits) >= threshold)
                kept_mass += tl.sum(tl.where(kept, exp_like_torch(logits - max_logit, ACCURATE_EXP), 0.0), axis=0)
            cut_key = _smallest_key_with_mass_below(
                row_ptr,
                vocab_size,
                threshold.to(tl.int64),
                tl.maximum(max_key, threshold).to(tl.int64),
                max_logit,
                top_p * kept_mass,
                BLOCK,
                PROBES,
                ACCURATE_EXP,
            )
            threshold = tl.maximum(threshold, cut_key.to(tl.int32))

    # Exponential race over the kept tokens: argmax of weight / noise.
    best_score = tl.full((), -1.0, tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        in_row = offsets < vocab_size
        logits = tl.load(row_ptr + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
        noise = tl.load(noise_row_ptr + offsets, mask=in_row, other=1.0).to(tl.float32)
        weights = exp_like_torch(logits - max_logit, ACCURATE_EXP)
        usable = in_row & (float_key(logits) >= threshold) & (weights > 0.0)
        # div_rn: IEEE division like torch's (a plain `/` compiles to the approximate div.full).
        scores = tl.where(usable, tl.math.div_rn(weights, noise), -1.0)
        block_best = tl.max(scores, axis=0)
        block_index = tl.argmax(scores, axis=0).to(tl.int32) + start
        best_index = tl.where(block_best > best_score, block_index, best_index)
        best_score = tl.maximum(best_score, block_best)
    tl.store(out_ptr + row, best_index.to(tl.int64))


def top_k_top_p_sample(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    exponential_noise: torch.Tensor,
    *,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Sample one token per row from the min-p/top-k/top-p filtered distribution.

    Args:
        logits: float ``[num_rows, vocab]`` (fp16/bf16/fp32; computed in fp32),
            temperature already applied; rows may be strided.
        top_k: int ``[num_rows]`` or None; entries <= 0 or >= vocab disable it.
        top_p: float ``[num_rows]`` in (0, 1] or None; 1 disables it.
        min_p: float ``[num_rows]`` in [0, 1] or None; 0 disables it.
        exponential_noise: float ``[num_rows, vocab]`` of Exp(1) draws.
        check_inputs: validate shapes, dtypes and value ranges (the range
            checks synchronise with the device; callers that built the inputs
            from validated ``SamplingParams`` pass False).

    Returns:
        int64 ``[num_rows]`` sampled token ids.
    """
    if check_inputs:
        check_sampling_inputs(logits, top_k, top_p, min_p, exponential_noise)
    require_launchable("logits", logits, _top_k_top_p_sample_kernel)
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    if logits.dtype == torch.float64:
        logits = logits.float()  # the semantics are float32; the kernel loads fp16/bf16/fp32
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    noise = exponential_noise.float()
    if noise.stride(-1) != 1:
        noise = noise.contiguous()
    placeholder = out  # never read: the matching USE_* flag is off
    top_k_arg = top_k.clamp(-1, vocab_size).to(torch.int32).contiguous() if top_k is not None else placeholder
    top_p_arg = top_p.float().contiguous() if top_p is not None else placeholder
    min_p_arg = min_p.float().contiguous() if min_p is not None else placeholder
    interpreted = is_interpreted(_top_k_top_p_sample_kernel)
    _top_k_top_p_sample_kernel[(num_rows,)](
        logits,
        logits.stride(0),
        noise,
        noise.stride(0),
        top_k_arg,
        top_p_arg,
        min_p_arg,
        out,
        vocab_size,
        USE_TOP_K=top_k is not None,
        USE_TOP_P=top_p is not None,
        USE_MIN_P=min_p is not None,
        BLOCK=vocab_block_size(vocab_size, interpreted),
        PROBES=NUM_PROBES,
        ACCURATE_EXP=not interpreted,
    )
    return out
