"""Triton rejection sampler for speculative decoding.

Same signature and semantics as :func:`servelab.reference.rejection_sample.rejection_sample`
(read its module docstring). One program per request walks its drafts: the
random accept test reads two scalars per draft (``p(x)``, ``q(x)``); greedy
rows take the argmax of each draft row until the first mismatch. Then one
streaming pass over the stopping row draws the recovered token from
``max(p - q, 0)`` (or the bonus token from ``p``) by exponential race against
the noise the wrapper drew, so the kernel returns exactly the reference's
tokens for the same generator state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from servelab.kernels._sampling_common import row_argmax, vocab_block_size
from servelab.kernels._triton_utils import is_interpreted, require_launchable
from servelab._internal.sampling_checks import check_draft_batch
from servelab._internal.sampling_noise import draw_rejection_noise


@triton.jit
def _race_row(p_row_ptr, q_row_ptr, draft_token, noise_row_ptr, vocab_size, SUBTRACT: tl.constexpr,
              HAS_DRAFT_PROBS: tl.constexpr, BLOCK: tl.constexpr):
    """Exponential race over max(p - q, 0) (SUBTRACT) or p; returns (index, best score)."""
    best_score = tl.full((), -1.0, tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        in_row = offsets < vocab_size
        weights = tl.load(p_row_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
        if SUBTRACT:
            if HAS_DRAFT_PROBS:
                q = tl.load(q_row_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
            else:
                q = tl.where(offsets == draft_token, 1.0, 0.0)
            weights = tl.maximum(weights - q, 0.0)
        noise = tl.load(noise_row_ptr + offsets, mask=in_row, other=1.0)
        # div_rn: IEEE division like torch's (a plain `/` compiles to the approximate div.full).
        scores = tl.where(in_row & (weights > 0.0), tl.math.div_rn(weights, noise), -1.0)
        block_best = tl.max(scores, axis=0)
        block_index = tl.argmax(scores, axis=0).to(tl.int32) + start
        best_index = tl.where(block_best > best_score, block_index, best_index)
        best_score = tl.maximum(best_score, block_best)
    return best_index, best_score


@triton.jit
def _rejection_sample_kernel(
    out_ptr,
    out_row_stride,
    draft_ids_ptr,
    draft_offsets_ptr,
    target_ptr,
    target_row_stride,
    draft_probs_ptr,
    draft_row_stride,
    greedy_ptr,
    uniform_ptr,
    noise_ptr,
    noise_row_stride,
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    first_draft = tl.load(draft_offsets_ptr + request).to(tl.int64)
    num_drafts = tl.load(draft_offsets_ptr + request + 1).to(tl.int64) - first_draft
    first_row = first_draft + request  # each earlier request also owns a bonus row
    is_greedy = tl.load(greedy_ptr + request) != 0
    out_row_ptr = out_ptr + request * out_row_stride

    num_accepted = tl.zeros((), tl.int64)
    still_accepting = tl.full((), 1, tl.int32)
    for position in range(0, num_drafts):
        if still_accepting != 0:
            draft = tl.load(draft_ids_ptr + first_draft + position).to(tl.int32)
            row_ptr = target_ptr + (first_row + position) * target_row_stride
            if is_greedy:
                accept = row_argmax(row_ptr, vocab_size, BLOCK) == draft
            else:
                p = tl.load(row_ptr + draft).to(tl.float32)
                if HAS_DRAFT_PROBS:
                    q = tl.load(draft_probs_ptr + (first_draft + position) * draft_row_stride + draft).to(tl.float32)
                else:
                    q = 1.0
                u = tl.load(uniform_ptr + first_draft + position)
                accept = u * q < p
            if accept:
                tl.store(out_row_ptr + position, draft.to(tl.int64))
                num_accepted += 1
            else:
                still_accepting = 0

    stop_row_ptr = target_ptr + (first_row + num_accepted) * target_row_stride
    noise_row_ptr = noise_ptr + request * noise_row_stride
    if is_greedy:
        final_token = row_argmax(stop_row_ptr, vocab_size, BLOCK)
    else:
        rejected_draft = first_draft + num_accepted  # meaningful only when a draft was rejected
        if num_accepted < num_drafts:
            draft = tl.load(draft_ids_ptr + rejected_draft).to(tl.int32)
            final_token, best = _race_row(stop_row_ptr, draft_probs_ptr + rejected_draft * draft_row_stride, draft,
                                          noise_row_ptr, vocab_size, True, HAS_DRAFT_PROBS, BLOCK)
            if best < 0.0:  # no residual mass (rounding): fall back to p
                final_token, best = _race_row(stop_row_ptr, stop_row_ptr, draft, noise_row_ptr, vocab_size,
                                              False, HAS_DRAFT_PROBS, BLOCK)
        else:
            final_token, best = _race_row(stop_row_ptr, stop_row_ptr, 0, noise_row_ptr, vocab_size,
                                          False, HAS_DRAFT_PROBS, BLOCK)
    tl.store(out_row_ptr + num_accepted, final_token.to(tl.int64))


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: bool | torch.Tensor = False,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Verify ragged drafts against the target (Triton); returns int64 ``[num_reqs, max(k_i) + 1]``.

    See :mod:`servelab.reference.rejection_sample` for the contract.
    """
    batch = check_draft_batch(
        draft_token_ids, num_draft_tokens, target_probs, draft_probs, greedy, generator, check_inputs=check_inputs
    )
    require_launchable("target_probs", target_probs, _rejection_sample_kernel)
    device = target_probs.device
    num_reqs, vocab_size = batch.num_reqs, batch.vocab_size
    out = torch.full((num_reqs, batch.max_draft + 1), -1, dtype=torch.int64, device=device)
    if num_reqs == 0:
        return out
    greedy_rows = [row for row, flag in enumerate(batch.greedy) if flag]
    uniform, noise = draw_rejection_noise(
        batch.num_draft_tokens, vocab_size, device, generator, skip_requests=greedy_rows
    )
    if target_probs.dtype == torch.float64 or target_probs.stride(-1) != 1:
        target_probs = target_probs.float().contiguous()
    if draft_probs is not None and (draft_probs.dtype == torch.float64 or draft_probs.stride(-1) != 1):
        draft_probs = draft_probs.float().contiguous()
    offsets = torch.tensor(batch.draft_offsets, dtype=torch.int64, device=device)
    greedy_flags = torch.tensor(batch.greedy, dtype=torch.int8, device=device)
    _rejection_sample_kernel[(num_reqs,)](
        out,
        out.stride(0),
        draft_token_ids.contiguous(),
        offsets,
        target_probs,
        target_probs.stride(0),
        draft_probs if draft_probs is not None else target_probs,  # placeholder, never read
        draft_probs.stride(0) if draft_probs is not None else 0,
        greedy_flags,
        uniform,
        noise,
        noise.stride(0),
        vocab_size,
        HAS_DRAFT_PROBS=draft_probs is not None,
        BLOCK=vocab_block_size(vocab_size, is_interpreted(_rejection_sample_kernel)),
    )
    return out
