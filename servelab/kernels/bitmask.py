"""Triton kernel: apply packed grammar bitmasks to logits.

Same signature and semantics as :func:`servelab.reference.bitmask.apply_token_bitmask`.
Grid ``(rows, cdiv(vocab, BLOCK))``: each program loads the ``BLOCK / 32``
words covering its slice of the vocabulary once, expands them to one bit per
token and stores ``-inf`` where the bit is 0. Rows not named by ``indices``
are never touched, so a batch where few requests carry a grammar costs only
their rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from servelab._internal.bitmask_checks import check_bitmask_args
from servelab.kernels._triton_utils import require_launchable

BLOCK = 1024


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, indices_ptr, vocab_size, stride_lt, stride_lv,
                                stride_bt, BLOCK: tl.constexpr):
    mask_row = tl.program_id(0)
    row = tl.load(indices_ptr + mask_row).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    words = tl.load(bitmask_ptr + mask_row * stride_bt + tokens // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_lt + tokens * stride_lv, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        indices: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """See :func:`servelab.reference.bitmask.apply_token_bitmask`; in place, returns ``logits``."""
    rows = check_bitmask_args(logits, bitmask, indices)
    require_launchable("logits", logits, _apply_token_bitmask_kernel)
    if rows.numel() and logits.shape[1]:
        grid = (rows.numel(), triton.cdiv(logits.shape[1], BLOCK))
        _apply_token_bitmask_kernel[grid](logits, bitmask.contiguous(), rows, logits.shape[1],
                                          logits.stride(0), logits.stride(1), bitmask.shape[1], BLOCK=BLOCK)
    return logits
