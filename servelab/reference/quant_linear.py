"""Reference quantized linear layers: dequantize the whole weight, then the float matmul.

Every quantization method of :mod:`servelab.quantization` (``int8``, ``w4a16``, the GGUF block
types) is held to :func:`quant_linear`: ``x @ dequantize(method, tensors).T + bias`` in float64
when ``x`` is float64. The dequantizers below are written from the block layouts element by
element (ggml's loops: one Python statement per field, vectorized only over blocks), not from
the fast path's vectorized forms, so the two are independent. Tests also hold these to the
``gguf`` package's own dequantizer.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize", "dequantize_gguf_block_rows", "quant_linear"]

_GGUF = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q4_K": (256, 144),
         "Q6_K": (256, 210), "F16": (1, 2), "F32": (1, 4)}


def _half(b: torch.Tensor, i: int) -> torch.Tensor:
    """Little-endian float16 at bytes ``i, i+1`` of every block row ``b [n, B]`` -> float64 ``[n]``."""
    raw = b[:, i].to(torch.int32) | (b[:, i + 1].to(torch.int32) << 8)
    return raw.to(torch.int16).view(torch.float16).double()


def _block(kind: str, b: torch.Tensor) -> torch.Tensor:
    """One GGUF block per row of ``b`` (uint8 ``[n, block_bytes]``) -> float64 ``[n, block_elems]``."""
    n = b.shape[0]
    if kind == "F32":
        return b.contiguous().view(torch.float32).double()
    if kind == "F16":
        return b.contiguous().view(torch.float16).double()
    out = torch.zeros(n, _GGUF[kind][0], dtype=torch.float64)
    u = b.to(torch.int64)
    if kind == "Q8_0":
        d = _half(b, 0)
        for j in range(32):
            q = u[:, 2 + j] - 256 * (u[:, 2 + j] >= 128)
            out[:, j] = d * q
    elif kind in ("Q4_0", "Q4_1"):
        d = _half(b, 0)
        m = _half(b, 2) if kind == "Q4_1" else None
        first = 4 if kind == "Q4_1" else 2
        for j in range(16):
            x0, x1 = u[:, first + j] & 0x0F, u[:, first + j] >> 4
            if m is None:
                out[:, j], out[:, j + 16] = (x0 - 8) * d, (x1 - 8) * d
            else:
                out[:, j], out[:, j + 16] = x0 * d + m, x1 * d + m
    elif kind == "Q5_0":
        d = _half(b, 0)
        qh = u[:, 2] | (u[:, 3] << 8) | (u[:, 4] << 16) | (u[:, 5] << 24)
        for j in range(16):
            xh0 = ((qh >> j) << 4) & 0x10
            xh1 = (qh >> (j + 12)) & 0x10
            out[:, j] = ((u[:, 6 + j] & 0x0F) | xh0) - 16
            out[:, j + 16] = ((u[:, 6 + j] >> 4) | xh1) - 16
        out *= d[:, None]
    elif kind == "Q4_K":
        _q4_k(u, _half(b, 0), _half(b, 2), out)
    elif kind == "Q6_K":
        _q6_k(u, _half(b, 208), out)
    else:
        raise ValueError(f"no reference dequantizer for GGUF type {kind!r}; valid: {', '.join(_GGUF)}")
    return out


def _scale_min_k4(j: int, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's ``get_scale_min_k4``: sub-block ``j``'s 6-bit scale and min from the 12 bytes ``s [n, 12]``."""
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    return ((s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4),
            (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4))


def _q4_k(u: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, out: torch.Tensor) -> None:
    scales, qs = u[:, 4:16], u[:, 16:144]
    y = 0
    for chunk in range(4):  # 64 weights: 32 low nibbles (sub-block 2c), 32 high nibbles (2c + 1)
        sc1, m1 = _scale_min_k4(2 * chunk, scales)
        sc2, m2 = _scale_min_k4(2 * chunk + 1, scales)
        q = qs[:, 32 * chunk: 32 * chunk + 32]
        for lane in range(32):
            out[:, y + lane] = d * sc1 * (q[:, lane] & 0xF) - dmin * m1
        for lane in range(32):
            out[:, y + 32 + lane] = d * sc2 * (q[:, lane] >> 4) - dmin * m2
        y += 64


def _q6_k(u: torch.Tensor, d: torch.Tensor, out: torch.Tensor) -> None:
    for half in range(2):
        ql, qh = u[:, 64 * half: 64 * half + 64], u[:, 128 + 32 * half: 128 + 32 * half + 32]
        sc = u[:, 192 + 8 * half: 192 + 8 * half + 8]
        sc = sc - 256 * (sc >= 128)
        base = 128 * half
        for lane in range(32):
            i = lane // 16
            q1 = ((ql[:, lane] & 0xF) | (((qh[:, lane] >> 0) & 3) << 4)) - 32
            q2 = ((ql[:, lane + 32] & 0xF) | (((qh[:, lane] >> 2) & 3) << 4)) - 32
            q3 = ((ql[:, lane] >> 4) | (((qh[:, lane] >> 4) & 3) << 4)) - 32
            q4 = ((ql[:, lane + 32] >> 4) | (((qh[:, lane] >> 6) & 3) << 4)) - 32
            out[:, base + lane] = d * sc[:, i] * q1
            out[:, base + lane + 32] = d * sc[:, i + 2] * q2
            out[:, base + lane + 64] = d * sc[:, i + 4] * q3
            out[:, base + lane + 96] = d * sc[:, i + 6] * q4


def dequantize_gguf_block_rows(kind: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """GGUF ``blocks`` uint8 ``[rows, in / block_elems * block_bytes]`` -> float64 ``[rows, in_features]``."""
    if kind not in _GGUF:
        raise ValueError(f"no reference dequantizer for GGUF type {kind!r}; valid: {', '.join(_GGUF)}")
    elems, size = _GGUF[kind]
    rows = blocks.shape[0]
    flat = blocks.reshape(-1, size)
    return _block(kind, flat).reshape(rows, in_features)


def dequantize(method: str, tensors: dict[str, torch.Tensor], in_features: int) -> torch.Tensor:
    """The float64 ``[out, in]`` weight a method's stored ``tensors`` encode.

    ``method``: ``"int8"`` (``qweight``, ``scales``), ``"w4a16"`` (``qweight``, ``scales``, ``zeros``)
    or a GGUF type name (``blocks``)."""
    if method == "int8":
        return tensors["qweight"].double() * tensors["scales"].double()[:, None]
    if method == "w4a16":
        packed, scales, zeros = tensors["qweight"], tensors["scales"].double(), tensors["zeros"].double()
        out_features = packed.shape[0]
        q = torch.zeros(out_features, in_features, dtype=torch.float64)
        q[:, 0::2] = (packed & 0xF).double()
        q[:, 1::2] = (packed >> 4).double()
        group = in_features // scales.shape[1]
        for g in range(scales.shape[1]):
            cols = slice(g * group, (g + 1) * group)
            q[:, cols] = (q[:, cols] - zeros[:, g:g + 1]) * scales[:, g:g + 1]
        return q
    return dequantize_gguf_block_rows(method, tensors["blocks"], in_features)


def quant_linear(x: torch.Tensor, method: str, tensors: dict[str, torch.Tensor], in_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, in]`` -> ``x @ W.T + bias`` ``[T, out]`` in ``x``'s dtype, ``W = dequantize(...)``."""
    weight = dequantize(method, tensors, in_features).to(x.dtype)
    out = x @ weight.T
    return out if bias is None else out + bias.to(x.dtype)
