"""Packed weight formats: how a quantized ``[out_features, in_features]`` weight is stored, and
the fast torch dequantizer of each (vectorized over blocks; the C and Triton kernels never call it).

Two families, one storage rule: every format keeps **row-major blocks along the input
dimension**, so output row ``n`` of the weight is row ``n`` of every stored tensor. That
makes row selection (an embedding lookup, a fused layer's HF slice, a rotary permutation of
q/k rows) a plain index on dimension 0, with no unpacking.

GGUF block types (llama.cpp's layouts, byte for byte; one tensor ``blocks``, uint8
``[out, in / block_elems * block_bytes]``):

=======  ===========  ===========  ===============================================
type     block_elems  block_bytes  one block
=======  ===========  ===========  ===============================================
Q8_0     32           34           f16 d; int8 q[32]; w = d * q
Q4_0     32           18           f16 d; 16 bytes of nibbles; w = d * (q - 8)
Q4_1     32           20           f16 d, f16 m; nibbles; w = d * q + m
Q5_0     32           22           f16 d; u32 high bits; nibbles; w = d * (q - 16)
Q4_K     256          144          f16 d, dmin; 12 bytes of 6-bit scales/mins; 128
                                   bytes of nibbles; 8 sub-blocks of 32:
                                   w = d * sc_j * q - dmin * m_j
Q6_K     256          210          128 bytes low nibbles, 64 bytes 2-bit highs,
                                   int8 scales[16], f16 d; w = d * sc_j * (q - 32)
F16/F32  1            2 / 4        the value
=======  ===========  ===========  ===============================================

In a 32-element block of the nibble types, byte ``j`` holds element ``j`` (low nibble)
and element ``j + 16`` (high nibble).

Online formats (servelab's own, quantized from a float weight at load):

- ``int8``: ``qweight`` int8 ``[out, in]``, ``scales`` float32 ``[out]``; symmetric per output
  channel: ``w = scales[n] * q``, ``q = round(w / s)`` clamped to [-127, 127], ``s = max|w_n| / 127``.
- ``w4a16``: ``qweight`` uint8 ``[out, in / 2]`` (element ``2i`` in the low nibble of byte
  ``i``, ``2i + 1`` in the high nibble), ``scales`` float32 ``[out, in / g]``, ``zeros`` uint8
  ``[out, in / g]``; asymmetric round-to-nearest per group of ``g`` inputs:
  ``w = scales * (q - zeros)``, ``q`` in [0, 15].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BlockFormat", "GGUF_FORMATS", "dequantize_gguf", "quantize_gguf", "quantize_int8", "dequantize_int8",
           "quantize_w4a16", "dequantize_w4a16", "gguf_row_bytes"]


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block type: ``block_elems`` weights stored in ``block_bytes`` bytes."""

    name: str
    block_elems: int
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_elems


GGUF_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q8_0", 32, 34), BlockFormat("Q4_0", 32, 18), BlockFormat("Q4_1", 32, 20),
    BlockFormat("Q5_0", 32, 22), BlockFormat("Q4_K", 256, 144), BlockFormat("Q6_K", 256, 210),
    BlockFormat("F16", 1, 2), BlockFormat("F32", 1, 4))}


def gguf_row_bytes(kind: str, in_features: int) -> int:
    """Bytes of one output row of ``in_features`` weights in GGUF type ``kind``; ValueError when the
    width is not a whole number of blocks."""
    fmt = GGUF_FORMATS[kind]
    if in_features % fmt.block_elems:
        raise ValueError(f"in_features={in_features} is not a multiple of {kind}'s block of {fmt.block_elems} "
                         "weights; valid: a multiple of the block")
    return in_features // fmt.block_elems * fmt.block_bytes


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes ``[start, start + 2)`` of each block ``[n, B]`` read as float16 -> float32 ``[n, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` bytes -> ``[n, 32]`` values: low nibbles (elements 0-15), then high (16-31)."""
    return torch.cat((qs & 0xF, qs >> 4), dim=1)


def _q4_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes ``[n, 12]`` -> 6-bit scales and mins ``[n, 8]`` each (int32)."""
    s = scales.to(torch.int32)
    low_sc, low_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    high_sc = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    high_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat((low_sc, high_sc), 1), torch.cat((low_m, high_m), 1)


def _dequantize_blocks(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks ``[n, block_bytes]`` uint8 -> float32 ``[n, block_elems]``."""
    if kind == "Q8_0":
        return _f16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()
    if kind == "Q4_0":
        return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8.0)
    if kind == "Q4_1":
        return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)
    if kind == "Q5_0":
        high = blocks[:, 2:6].to(torch.int64)
        qh = high[:, 0] | (high[:, 1] << 8) | (high[:, 2] << 16) | (high[:, 3] << 24)
        bits = (qh[:, None] >> torch.arange(32, device=blocks.device)) & 1
        return _f16(blocks, 0) * ((_nibbles(blocks[:, 6:]).to(torch.int64) | (bits << 4)).float() - 16.0)
    if kind == "Q4_K":
        sc, m = _q4_k_scales(blocks[:, 4:16])
        qs = blocks[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 64 weights: low nibbles, then high
        q = torch.stack((qs & 0xF, qs >> 4), dim=2).reshape(-1, 8, 32).float()
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        return ((d * sc.float())[:, :, None] * q - (dmin * m.float())[:, :, None]).reshape(-1, 256)
    if kind == "Q6_K":
        ql, qh = blocks[:, 0:128].reshape(-1, 2, 64), blocks[:, 128:192].reshape(-1, 2, 32)
        sc = blocks[:, 192:208].contiguous().view(torch.int8).float()
        parts = (ql[:, :, 0:32] & 0xF | ((qh & 3) << 4), ql[:, :, 32:64] & 0xF | (((qh >> 2) & 3) << 4),
                 ql[:, :, 0:32] >> 4 | (((qh >> 4) & 3) << 4), ql[:, :, 32:64] >> 4 | (((qh >> 6) & 3) << 4))
        q = torch.stack(parts, dim=2).reshape(-1, 256).float() - 32.0  # [n, half, part, 32] -> element order
        return _f16(blocks, 208) * sc.repeat_interleave(16, dim=1) * q
    if kind == "F16":
        return blocks.contiguous().view(torch.float16).float()
    if kind == "F32":
        return blocks.contiguous().view(torch.float32)
    raise ValueError(f"GGUF tensor type {kind!r} has no dequantizer; valid: {', '.join(GGUF_FORMATS)}")


def dequantize_gguf(kind: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """``blocks`` uint8 ``[rows, row_bytes]`` of GGUF type ``kind`` -> float32 ``[rows, in_features]``."""
    fmt = GGUF_FORMATS.get(kind)
    if fmt is None:
        raise ValueError(f"GGUF tensor type {kind!r} has no dequantizer; valid: {', '.join(GGUF_FORMATS)}")
    rows = blocks.shape[0]
    if blocks.dtype is not torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != gguf_row_bytes(kind, in_features):
        raise ValueError(f"blocks (shape {tuple(blocks.shape)}, {blocks.dtype}) must be uint8 "
                         f"[rows, {gguf_row_bytes(kind, in_features)}] for {kind} rows of {in_features} weights")
    flat = blocks.reshape(-1, fmt.block_bytes)
    return _dequantize_blocks(kind, flat).reshape(rows, in_features)


def _f16_bytes(values: torch.Tensor) -> torch.Tensor:
    """float ``[n]`` -> its float16 bytes ``[n, 2]``."""
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def quantize_gguf(kind: str, weight: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest ``weight`` float ``[out, in]`` into GGUF blocks (Q8_0, Q4_0, Q4_1, F16, F32:
    llama.cpp's reference quantizers); uint8 ``[out, row_bytes]``. The K-quants are read from files only."""
    out_features, in_features = weight.shape
    gguf_row_bytes(kind, in_features)  # refuses a width that is not whole blocks
    w = weight.detach().float().cpu()
    if kind == "F32":
        return w.contiguous().view(torch.uint8).reshape(out_features, -1)
    if kind == "F16":
        return w.to(torch.float16).contiguous().view(torch.uint8).reshape(out_features, -1)
    x = w.reshape(-1, 32)
    if kind == "Q8_0":
        d = x.abs().amax(1) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = (x * inv[:, None]).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        blocks = torch.cat((_f16_bytes(d), q), 1)
    elif kind == "Q4_0":
        index = x.abs().argmax(1, keepdim=True)
        d = x.gather(1, index).squeeze(1) / -8.0  # the signed extreme maps to -8, as llama.cpp does
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = (x * inv[:, None] + 8.5).floor().clamp(0, 15).to(torch.uint8)
        blocks = torch.cat((_f16_bytes(d), q[:, :16] | (q[:, 16:] << 4)), 1)
    elif kind == "Q4_1":
        low, high = x.amin(1), x.amax(1)
        d = (high - low) / 15.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = ((x - low[:, None]) * inv[:, None] + 0.5).floor().clamp(0, 15).to(torch.uint8)
        blocks = torch.cat((_f16_bytes(d), _f16_bytes(low), q[:, :16] | (q[:, 16:] << 4)), 1)
    else:
        raise ValueError(f"no online quantizer for GGUF type {kind!r}; valid: Q8_0, Q4_0, Q4_1, F16, F32")
    return blocks.reshape(out_features, -1).contiguous()


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` float ``[out, in]`` -> ``{"qweight": int8 [out, in], "scales": float32 [out]}``
    (symmetric per output channel; an all-zero row gets scale 0)."""
    w = weight.detach().float()
    scales = w.abs().amax(1) / 127.0
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = (w * inv[:, None]).round().clamp(-127, 127).to(torch.int8)
    return {"qweight": q.contiguous(), "scales": scales.contiguous()}


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 ``[out, in]`` and float32 ``[out]`` -> float32 ``[out, in]``."""
    return qweight.float() * scales[:, None]


def quantize_w4a16(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """``weight`` float ``[out, in]`` -> ``{"qweight": uint8 [out, in/2], "scales": float32 [out, in/g],
    "zeros": uint8 [out, in/g]}``: asymmetric round-to-nearest 4-bit per group of ``group_size`` inputs.
    Raises ValueError when ``group_size`` does not divide ``in``."""
    out_features, in_features = weight.shape
    if group_size <= 0 or group_size % 2 or in_features % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={in_features} into even groups; "
                         "valid: an even divisor of the input width (32 or 128 for the kernels)")
    w = weight.detach().float().reshape(out_features, -1, group_size)
    low = w.amin(2).clamp(max=0.0)   # the range always holds 0, so a zero weight stays exact
    high = w.amax(2).clamp(min=0.0)
    scales = (high - low) / 15.0
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    zeros = (-low * inv).round().clamp(0, 15)
    q = (w * inv[:, :, None] + zeros[:, :, None]).round().clamp(0, 15).to(torch.uint8)
    q = q.reshape(out_features, in_features)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return {"qweight": packed.contiguous(), "scales": scales.contiguous(), "zeros": zeros.to(torch.uint8).contiguous()}


def dequantize_w4a16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The ``w4a16`` tensors -> float32 ``[out, in]``."""
    out_features = qweight.shape[0]
    q = torch.stack((qweight & 0xF, qweight >> 4), dim=2).reshape(out_features, -1).float()
    group = q.shape[1] // scales.shape[1]
    q = q.reshape(out_features, -1, group)
    return ((q - zeros.float()[:, :, None]) * scales[:, :, None]).reshape(out_features, -1)
