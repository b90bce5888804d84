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


def key_smoothing_factors(amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """float32 ``[..., D]`` factors of ``amax`` ``[..., D]``: per channel ``c`` (``h = D / 2``),
    ``a_c = max(amax_c, amax_{(c + h) mod D})``, ``m_c = max(a_c / max_j a_j, 1e-3) ** alpha`` (all
    ones where ``max_j a_j = 0``)."""
    a = amax.to(torch.float64).abs()
    d = a.shape[-1]
    h = d // 2
    out = torch.empty_like(a)
    for c in range(d):
        out[..., c] = torch.maximum(a[..., c], a[..., (c + h) % d])
    top = out.amax(dim=-1, keepdim=True)
    ratio = torch.where(top > 0, out / torch.where(top > 0, top, torch.ones_like(top)), torch.ones_like(out))
    return torch.clamp(ratio, min=1e-3).pow(float(alpha)).to(torch.float32)


def smoothed_key_roundtrip(k: torch.Tensor, factors: torch.Tensor, max_value: float,
                           storage_dtype: torch.dtype) -> torch.Tensor:
    """What a smoothed key page reads back, in the original key's units, float64 ``[T, Hk, D]``:
    ``factors * dequantize(quantize(k / factors))`` with each row's own scale (``factors``
    ``[Hk, D]``). The query meets ``(q * factors) . dequantize(...)``, the same dot product."""
    x = k.to(torch.float64) / factors.to(torch.float64)
    scale = row_scales(x, max_value)
    return dequantize(quantize(x, scale, max_value, storage_dtype), scale) * factors.to(torch.float64)
