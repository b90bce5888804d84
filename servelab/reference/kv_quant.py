"""Reference quantize / dequantize of KV pages: the spec of :mod:`servelab.blocks.kv_quant`.

Everything in float64, element by element formulas with no fused tricks: a row's
scale is ``amax(|x|) / max_value`` (1.0 for an all-zero row), stored as float32;
``q = clamp(x / scale, ±max_value)`` rounded half to even (int8) or cast (fp8, which
rounds to nearest even); ``dequantize(q, scale) = q * scale``.
"""

from __future__ import annotations

import torch


def row_scales(x: torch.Tensor, max_value: float) -> torch.Tensor:
    """float32 ``[T, Hk]`` scales of ``x`` ``[T, Hk, D]``."""
    amax = x.to(torch.float64).abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / max_value, torch.ones_like(amax))
    return scale.to(torch.float32)


def quantize(x: torch.Tensor, scale: torch.Tensor, max_value: float, storage_dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., D]`` over ``scale`` ``[...]`` -> ``storage_dtype`` ``[..., D]``."""
    y = x.to(torch.float64) / scale.to(torch.float64)[..., None]
    y = torch.clamp(y, -max_value, max_value)
    if not storage_dtype.is_floating_point:
        y = torch.round(y)
    return y.to(storage_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 ``q * scale`` (``q`` ``[..., D]``, ``scale`` ``[...]``)."""
    return q.to(torch.float64) * scale.to(torch.float64)[..., None]
