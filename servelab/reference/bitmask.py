"""Reference: apply packed grammar bitmasks to logits.

A bitmask row holds ``ceil(vocab / 32)`` int32 words; bit ``t % 32`` of word
``t // 32`` is 1 when token ``t`` is allowed. Disallowed tokens get ``-inf``.
This is the spec for :func:`servelab.kernels.bitmask.apply_token_bitmask`
(Triton) and the CPU fast path in :mod:`servelab.samplers.structured`: the
same signature, the same result bit for bit. Written as plain loops over
rows and tokens, to be obviously right rather than fast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelab._internal.bitmask_checks import check_bitmask_args


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        indices: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """Set disallowed tokens of the masked rows to ``-inf``, in place; returns ``logits``.

    Args:
        logits: float ``[num_tokens, vocab]`` (any float dtype).
        bitmask: int32 ``[rows, ceil(vocab / 32)]``; ``-1`` (all bits set) allows everything.
        indices: the ``logits`` row each bitmask row applies to (int ``[rows]``,
            no repeats); None means row ``i`` -> row ``i`` (then ``rows == num_tokens``).
            Rows of ``logits`` not named are left alone ("rows without a mask").

    A row whose mask allows nothing becomes all ``-inf``: deciding what that
    means (a per-request error) is the caller's job, not this op's.
    """
    rows = check_bitmask_args(logits, bitmask, indices).tolist()
    vocab = logits.shape[1]
    words = bitmask.tolist()
    for mask_row, row in enumerate(rows):
        for token in range(vocab):
            word = words[mask_row][token // 32] & 0xFFFFFFFF  # as unsigned: bit 31 is a token too
            if not (word >> (token % 32)) & 1:
                logits[row, token] = float("-inf")
    return logits
