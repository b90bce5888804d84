"""Triton W8A16 / W4A16 GEMM: ``x [M, K] @ W.T (+ bias)`` with ``W`` stored as servelab's ``int8``
(per output channel scales) or ``w4a16`` (4-bit nibbles with a scale and a zero point per group of
``g`` inputs) tensors (:mod:`servelab.quantization.formats`); the float weight exists only as a
``[BLOCK_K, BLOCK_N]`` tile in registers.

Same signature and semantics as :func:`servelab.reference.quant_linear.quant_linear` (restricted to
the two methods). Each program computes a ``[BLOCK_M, BLOCK_N]`` output tile, walking ``K`` in
tiles of ``BLOCK_K`` (32: a tile never straddles a group for ``g`` in 32, 64, 128): it loads the
packed bytes, extracts the nibble (``(byte >> 4 * (k % 2)) & 15``) or the int8, applies the tile's
scale (and zero), and accumulates ``tl.dot`` in float32. The output is in ``x``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelab.kernels._triton_utils import dot_in_fp32, is_interpreted, require_launchable

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_K = 32


@triton.jit
def _quant_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, groups, group,
                       stride_xm, stride_om,
                       W4: tl.constexpr, HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows < M)[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = k_ok[:, None] & (cols < N)[None, :]
        if W4:
            packed = tl.load(q_ptr + cols[None, :].to(tl.int64) * (K // 2) + (ks // 2)[:, None], mask=w_mask,
                             other=0).to(tl.int32)
            q = (packed >> ((ks % 2) * 4)[:, None]) & 15
            g = (ks // group)[:, None]
            scale = tl.load(s_ptr + cols[None, :] * groups + g, mask=w_mask, other=0.0)
            zero = tl.load(z_ptr + cols[None, :] * groups + g, mask=w_mask, other=0).to(tl.float32)
            w = (q.to(tl.float32) - zero) * scale
        else:
            q = tl.load(q_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=w_mask, other=0)
            w = q.to(tl.float32)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w)
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if not W4:
        acc = acc * tl.load(s_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


INTERPRETED = is_interpreted(_quant_gemm_kernel)


def quant_gemm(x: torch.Tensor, method: str, tensors: dict[str, torch.Tensor], in_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, in_features]`` (float16 / bfloat16 / float32, rows contiguous) -> ``[M, out]`` in ``x``'s dtype.

    ``method``: ``"int8"`` (``qweight`` int8 ``[out, in]``, ``scales`` float32 ``[out]``) or ``"w4a16"``
    (``qweight`` uint8 ``[out, in / 2]``, ``scales`` float32 ``[out, in / g]``, ``zeros`` uint8
    ``[out, in / g]``, ``g`` a multiple of 32). Raises ValueError naming what does not fit."""
    if method not in ("int8", "w4a16"):
        raise ValueError(f"method={method!r} has no Triton kernel; valid: 'int8', 'w4a16'")
    if x.dim() != 2 or x.dtype not in KERNEL_DTYPES or x.shape[1] != in_features:
        raise ValueError(f"x (shape {tuple(x.shape)}, {x.dtype}) must be [M, {in_features}] in "
                         f"{', '.join(map(str, KERNEL_DTYPES))}")
    require_launchable("x", x, _quant_gemm_kernel)
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight, scales = tensors["qweight"].contiguous(), tensors["scales"].float().contiguous()
    out_features = qweight.shape[0]
    w4 = method == "w4a16"
    groups = scales.shape[1] if w4 else 1
    group = in_features // groups
    if w4 and (group % BLOCK_K or in_features % group):
        raise ValueError(f"w4a16 group size {group} must be a multiple of {BLOCK_K} dividing in_features="
                         f"{in_features} for the Triton kernel")
    zeros = tensors["zeros"].contiguous() if w4 else scales
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    block_m = 16
    block_n = 32
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(out_features, block_n))
    if x.shape[0] and out_features:
        _quant_gemm_kernel[grid](x, qweight, scales, zeros, bias if bias is not None else scales, out,
                                 x.shape[0], out_features, in_features, groups, group, x.stride(0), out.stride(0),
                                 W4=w4, HAS_BIAS=bias is not None,
                                 FP32_DOT=dot_in_fp32(x.dtype, INTERPRETED) or x.dtype is torch.float32,
                                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K)
    return out
