"""Triton LoRA kernels: SGMV (prefill segments, one adapter per segment) and BGMV
(one adapter index per decode row), shrink and expand, with slice offsets and
``-1`` rows. Same signatures and semantics as :mod:`servelab.reference.lora`
(the spec; the layout is documented there) and the CPU fast path
:mod:`servelab.lora.ops`.

Design: float32 accumulation whatever the input dtype; every operand is
addressed through its strides, so a fused layer's slice (a column block of the
shrink output, a row block of the stacked B) is passed as a view, never
copied. A row without an adapter is masked out of every load and store (its
slot clamped to 0 for the address), so shrink leaves zeros and expand leaves
the output as it was. Reductions are broadcast multiply + ``tl.sum`` rather
than ``tl.dot``: LoRA ranks (1-64) are often below ``tl.dot``'s 16-wide
minimum, and the products are small next to the base GEMM.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from servelab.kernels._triton_utils import require_launchable

__all__ = ["TRITON_KERNEL", "bgmv_expand", "bgmv_shrink", "sgmv_expand", "sgmv_shrink"]


@triton.jit
def _bgmv_kernel(x_ptr, w_ptr, idx_ptr, out_ptr, N, K, scale, slice_offset,
                 stride_xt, stride_xk, stride_ws, stride_wn, stride_wk, stride_ot, stride_on,
                 ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, off + n] (+)= scale * sum_k w[slot_t, n, k] * x[t, k] for one row t and BLOCK_N outputs."""
    t = tl.program_id(0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(idx_ptr + t)
    # masks compared as vectors (the interpreter refuses a scalar bool & a vector as a mask)
    n_mask = (ns < N) & ((ns * 0 + slot) >= 0)
    slot = tl.maximum(slot, 0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = (ks < K) & ((ks * 0 + tl.load(idx_ptr + t)) >= 0)
        x = tl.load(x_ptr + t * stride_xt + ks * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + slot * stride_ws + ns[:, None] * stride_wn + ks[None, :] * stride_wk,
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    acc = acc * scale
    out_ptrs = out_ptr + t * stride_ot + (slice_offset + ns) * stride_on
    if ADD:
        acc += tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, starts_ptr, lens_ptr, slots_ptr, out_ptr, N, K, scale, slice_offset,
                 stride_xt, stride_xk, stride_ws, stride_wn, stride_wk, stride_ot, stride_on,
                 ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One segment's BLOCK_M rows x BLOCK_N outputs: out (+)= scale * x_rows @ w[slot].T."""
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg)
    length = tl.load(lens_ptr + seg)
    slot = tl.load(slots_ptr + seg)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = (ms < length) & ((ms * 0 + slot) >= 0)  # vectors: see _bgmv_kernel
    n_mask = ns < N
    slot = tl.maximum(slot, 0)
    rows = start + ms
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + slot * stride_ws + ns[:, None] * stride_wn + ks[None, :] * stride_wk,
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    acc = acc * scale
    out_ptrs = out_ptr + rows[:, None] * stride_ot + (slice_offset + ns)[None, :] * stride_on
    mask = m_mask[:, None] & n_mask[None, :]
    if ADD:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _blocks(n: int, k: int) -> tuple[int, int]:
    return min(64, max(16, triton.next_power_of_2(n))), min(64, max(16, triton.next_power_of_2(k)))


def _check(name: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, slice_offset: int) -> None:
    if x.dim() != 2 or w.dim() != 3 or out.dim() != 2:
        raise ValueError(f"{name}: x/y must be [T, K], the weights [S, N, K], the output [T, *]; got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(out.shape)}")
    if w.shape[2] != x.shape[1] or out.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: shapes {tuple(x.shape)}, {tuple(w.shape)}, {tuple(out.shape)} disagree "
                         "(weights' last dim must be x's columns; output rows x's rows)")
    if not 0 <= slice_offset <= out.shape[1] - w.shape[1]:
        raise ValueError(f"{name}: slice_offset={slice_offset} puts {w.shape[1]} columns outside the output's "
                         f"{out.shape[1]}")
    require_launchable(name, x, _bgmv_kernel)


def _bgmv(name: str, x: torch.Tensor, w: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, scale: float,
          slice_offset: int, add: bool) -> torch.Tensor:
    _check(name, x, w, out, slice_offset)
    num_tokens, n = x.shape[0], w.shape[1]
    if num_tokens == 0 or n == 0:
        return out
    block_n, block_k = _blocks(n, x.shape[1])
    _bgmv_kernel[(num_tokens, triton.cdiv(n, block_n))](
        x, w, indices.to(device=x.device, dtype=torch.int64).contiguous(), out, n, x.shape[1], float(scale),
        slice_offset, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        out.stride(1), ADD=add, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def _sgmv(name: str, x: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
          slots: torch.Tensor, out: torch.Tensor, scale: float, slice_offset: int, add: bool) -> torch.Tensor:
    _check(name, x, w, out, slice_offset)
    n = w.shape[1]
    if len(lens) == 0 or n == 0 or x.shape[0] == 0:
        return out
    max_len = int(lens.max())
    if max_len == 0:
        return out
    block_m = min(32, max(16, triton.next_power_of_2(max_len)))
    block_n, block_k = _blocks(n, x.shape[1])
    block_n, block_k = min(block_n, 32), min(block_k, 32)  # a [M, N, K] product lives in registers

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=x.device, dtype=torch.int64).contiguous()

    grid = (len(lens), triton.cdiv(max_len, block_m), triton.cdiv(n, block_n))
    _sgmv_kernel[grid](x, w, dev(starts), dev(lens), dev(slots), out, n, x.shape[1], float(scale), slice_offset,
                       x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
                       out.stride(1), ADD=add, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def _shrink_out(x: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
    return torch.zeros((x.shape[0], lora_a.shape[1]), dtype=torch.promote_types(x.dtype, torch.float32),
                       device=x.device)


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """See :func:`servelab.reference.lora.bgmv_shrink`."""
    return _bgmv("bgmv_shrink", x, lora_a, indices, _shrink_out(x, lora_a), scale, 0, False)


def bgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor, output: torch.Tensor,
                slice_offset: int = 0, add_inputs: bool = True) -> torch.Tensor:
    """See :func:`servelab.reference.lora.bgmv_expand`."""
    return _bgmv("bgmv_expand", y, lora_b, indices, output, 1.0, slice_offset, add_inputs)


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                seg_slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """See :func:`servelab.reference.lora.sgmv_shrink`."""
    return _sgmv("sgmv_shrink", x, lora_a, seg_starts, seg_lens, seg_slots, _shrink_out(x, lora_a), scale, 0,
                 False)


def sgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                seg_slots: torch.Tensor, output: torch.Tensor, slice_offset: int = 0,
                add_inputs: bool = True) -> torch.Tensor:
    """See :func:`servelab.reference.lora.sgmv_expand`."""
    return _sgmv("sgmv_expand", y, lora_b, seg_starts, seg_lens, seg_slots, output, 1.0, slice_offset, add_inputs)


#: The ``"triton"`` LoRA kernel.
TRITON_KERNEL = SimpleNamespace(name="triton", bgmv_shrink=bgmv_shrink, bgmv_expand=bgmv_expand,
                                sgmv_shrink=sgmv_shrink, sgmv_expand=sgmv_expand)
