"""The CPU fast path of the LoRA kernels: the same four functions as
:mod:`servelab.kernels.lora` (Triton) and :mod:`servelab.reference.lora` (the spec;
layout and semantics are documented there), as a few dense GEMMs per adapter.

Why grouped GEMMs: a step's rows use at most ``max_loras`` distinct slots, so
gathering each slot's rows and running ``x_g @ A.T`` then ``y_g @ B.T`` costs
one small GEMM pair per slot — the same arithmetic as the per-row
BGMV, without materialising a ``[T, R, in]`` gather of A per row. SGMV's
segments are already grouped: each segment is one GEMM pair, no gather.

Arithmetic is float32 (bf16/fp16 inputs upcast, as the Triton kernels accumulate),
float64 for float64 inputs (the tests' precision).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

__all__ = ["bgmv_expand", "bgmv_shrink", "sgmv_expand", "sgmv_shrink", "slot_groups"]


def slot_groups(indices: torch.Tensor) -> list[tuple[int, torch.Tensor | slice]]:
    """``[(slot, rows)]`` for each slot present in ``indices`` ``[T]`` (``-1`` skipped);
    ``rows`` is a slice when the slot's rows are contiguous (no gather needed)."""
    if indices.numel() == 0:
        return []
    values = indices.tolist()
    groups: dict[int, list[int]] = {}
    for t, slot in enumerate(values):
        if slot >= 0:
            groups.setdefault(slot, []).append(t)
    out: list[tuple[int, torch.Tensor | slice]] = []
    for slot, rows in groups.items():
        if rows[-1] - rows[0] + 1 == len(rows):
            out.append((slot, slice(rows[0], rows[-1] + 1)))
        else:
            out.append((slot, torch.tensor(rows, dtype=torch.int64, device=indices.device)))
    return out


def _shrink_groups(x: torch.Tensor, lora_a: torch.Tensor, groups: list[tuple[int, torch.Tensor | slice]],
                   scale: float) -> torch.Tensor:
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=acc, device=x.device)
    for slot, rows in groups:
        part = x[rows].to(acc) @ lora_a[slot].to(acc).T
        out[rows] = part * scale if scale != 1.0 else part
    return out


def _expand_groups(y: torch.Tensor, lora_b: torch.Tensor, groups: list[tuple[int, torch.Tensor | slice]],
                   output: torch.Tensor, slice_offset: int, add_inputs: bool) -> torch.Tensor:
    size = lora_b.shape[1]
    target = output[:, slice_offset:slice_offset + size]
    acc = torch.promote_types(y.dtype, torch.float32)
    for slot, rows in groups:
        delta = y[rows].to(acc) @ lora_b[slot].to(acc).T
        if add_inputs:
            delta = delta + target[rows].to(acc)
        target[rows] = delta.to(output.dtype)
    return output


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x [T, in]``, ``lora_a [S, R, in]``, ``indices [T]`` -> ``[T, R]`` float32 (float64 for float64
    ``x``), zeros where -1."""
    return _shrink_groups(x, lora_a, slot_groups(indices), scale)


def bgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor, output: torch.Tensor,
                slice_offset: int = 0, add_inputs: bool = True) -> torch.Tensor:
    """``output[t, off:off+N] (+)= y[t] @ lora_b[slot].T`` for rows with a slot; returns ``output``."""
    return _expand_groups(y, lora_b, slot_groups(indices), output, slice_offset, add_inputs)


def _segment_groups(seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                    seg_slots: torch.Tensor) -> list[tuple[int, torch.Tensor | slice]]:
    return [(slot, slice(start, start + length))
            for start, length, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist())
            if slot >= 0 and length > 0]


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                seg_slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """:func:`bgmv_shrink` with each row's slot given by segments (rows outside them: zeros)."""
    return _shrink_groups(x, lora_a, _segment_groups(seg_starts, seg_lens, seg_slots), scale)


def sgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                seg_slots: torch.Tensor, output: torch.Tensor, slice_offset: int = 0,
                add_inputs: bool = True) -> torch.Tensor:
    """:func:`bgmv_expand` with each row's slot given by segments."""
    return _expand_groups(y, lora_b, _segment_groups(seg_starts, seg_lens, seg_slots), output, slice_offset,
                          add_inputs)


#: The ``"torch"`` LoRA kernel (the CPU fast path).
CPU_KERNEL = SimpleNamespace(name="torch", bgmv_shrink=bgmv_shrink, bgmv_expand=bgmv_expand,
                             sgmv_shrink=sgmv_shrink, sgmv_expand=sgmv_expand)
