"""Argument checks shared by :func:`servelab.reference.bitmask.apply_token_bitmask`,
its Triton twin and the CPU fast path (private)."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def num_bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens: ``ceil(vocab_size / 32)``."""
    return -(-vocab_size // 32)


def check_bitmask_args(logits: object, bitmask: object, indices: object) -> torch.Tensor:
    """Validate the arguments; returns the row index per bitmask row (int64 ``[B]``, on ``logits``' device)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"logits must be a 2-D float tensor [num_tokens, vocab], got "
                         f"{_describe(logits)}")
    if not isinstance(bitmask, torch.Tensor) or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be a 2-D int32 tensor [rows, ceil(vocab / 32)], got {_describe(bitmask)}")
    words = num_bitmask_words(logits.shape[1])
    if bitmask.shape[1] != words:
        raise ValueError(f"bitmask has {bitmask.shape[1]} words per row; a vocabulary of {logits.shape[1]} "
                         f"needs ceil({logits.shape[1]} / 32) = {words}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device} but logits are on {logits.device}")
    if indices is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows but logits have {logits.shape[0]}; "
                             "pass indices to mask a subset of rows")
        return torch.arange(logits.shape[0], device=logits.device)
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"indices must be a 1-D int tensor, got {_describe(indices)}")
        rows = indices.to(device=logits.device, dtype=torch.int64)
    else:
        try:
            rows = torch.tensor(list(indices), dtype=torch.int64, device=logits.device)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"indices must be a sequence of ints, got {indices!r}") from None
        if rows.dim() != 1:
            raise ValueError(f"indices must be 1-D, got shape {tuple(rows.shape)}")
    if rows.numel() != bitmask.shape[0]:
        raise ValueError(f"indices has {rows.numel()} entries but bitmask has {bitmask.shape[0]} rows")
    if rows.numel():
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= logits.shape[0]:
            raise ValueError(f"indices must lie in [0, {logits.shape[0]}), got {low if low < 0 else high}")
        if rows.unique().numel() != rows.numel():
            raise ValueError("indices must not repeat a row")
    return rows


def _describe(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return f"{obj.dtype} tensor of shape {tuple(obj.shape)}"
    return type(obj).__name__
