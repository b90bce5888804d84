"""Apply packed grammar bitmasks to logits: the public op, with backend choice.

``apply_token_bitmask(logits, bitmask, indices=None, *, backend="auto")``:
``"triton"`` (:mod:`servelab.kernels.bitmask`; CUDA tensors, or CPU under
``TRITON_INTERPRET=1``), ``"torch"`` (vectorised torch below: the CPU fast
path). ``"auto"`` picks Triton for CUDA tensors and torch otherwise. The
spec both are held to is :func:`servelab.reference.bitmask.apply_token_bitmask`.

Where it runs in a step (the order vLLM v1 uses): on the raw logits of the
rows to sample, *before* the sampler, so the sampler's first step (the raw
logprobs snapshot) and every later one see the masked distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelab._internal.bitmask_checks import check_bitmask_args

__all__ = ["apply_token_bitmask", "bitmask_allows_nothing", "unpack_bitmask"]

_BIT_VALUES = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[rows, vocab_size]``: True where a token is allowed."""
    bits = bitmask.unsqueeze(-1) & _BIT_VALUES.to(bitmask.device)  # [rows, words, 32]
    return bits.bool().reshape(bitmask.shape[0], -1)[:, :vocab_size]


def bitmask_allows_nothing(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[rows]``: rows whose mask allows no token of ``vocab_size``."""
    return ~unpack_bitmask(bitmask, vocab_size).any(dim=1)


def _apply_torch(logits: torch.Tensor, bitmask: torch.Tensor, indices: object) -> torch.Tensor:
    rows = check_bitmask_args(logits, bitmask, indices)
    if indices is None:  # every row masked: no gather / scatter
        return logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))
    if rows.numel():
        allowed = unpack_bitmask(bitmask, logits.shape[1])
        selected = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
        logits.index_copy_(0, rows, selected)
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        indices: torch.Tensor | Sequence[int] | None = None, *,
                        backend: str = "auto") -> torch.Tensor:
    """Set tokens a row's bitmask disallows to ``-inf``, in place; returns ``logits``.

    Args:
        logits: float ``[num_tokens, vocab]``.
        bitmask: int32 ``[rows, ceil(vocab / 32)]``; bit ``t % 32`` of word
            ``t // 32`` set = token ``t`` allowed; ``-1`` words allow all.
        indices: logits row per bitmask row (int ``[rows]``); None = identity.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend={backend!r} is invalid; valid: 'auto', 'torch', 'triton'")
    device = logits.device if isinstance(logits, torch.Tensor) else torch.device("cpu")
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        from servelab.kernels.bitmask import apply_token_bitmask as triton_apply

        return triton_apply(logits, bitmask, indices)
    return _apply_torch(logits, bitmask, indices)
