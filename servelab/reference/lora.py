"""Plain PyTorch references of the LoRA kernels (same signatures as
:mod:`servelab.kernels.lora` and the CPU fast path :mod:`servelab.lora.ops`).

Layout (vLLM's Punica layout, one buffer per wrapped layer and per slot):

- ``lora_a``: ``[num_slots, R, in_features]``: each slot's A rows (all of a fused
  layer's slices stacked, ``R = num_slices * max_rank``);
- ``lora_b``: ``[num_slots, N, r]``: each slot's B (scaling already folded in),
  ``N`` output rows of one slice;
- ``indices``: int ``[T]``, the slot of each token row, ``-1`` for a row without
  an adapter (it is left unchanged / gets zeros);
- segments (SGMV, prefill): ``seg_starts``, ``seg_lens``, ``seg_slots`` int
  ``[S]``: rows ``seg_starts[s] .. + seg_lens[s]`` all use slot ``seg_slots[s]``
  (``-1``: none). Rows in no segment are untouched.

Shrink computes ``y[t] = scale * x[t] @ lora_a[slot].T`` in float32 (float64 for
float64 inputs); expand adds
``y[t] @ lora_b[slot].T`` into ``output[t, slice_offset : slice_offset + N]``
(``add_inputs=False`` overwrites instead), in float32, cast to ``output``'s dtype.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

__all__ = ["bgmv_expand", "bgmv_shrink", "segments_to_indices", "sgmv_expand", "sgmv_shrink"]


def segments_to_indices(num_tokens: int, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                        seg_slots: torch.Tensor) -> torch.Tensor:
    """int64 ``[num_tokens]`` slot of each row (``-1`` outside every segment)."""
    indices = torch.full((num_tokens,), -1, dtype=torch.int64)
    for start, length, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist()):
        indices[start:start + length] = slot
    return indices


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x [T, in]``, ``lora_a [S, R, in]``, ``indices [T]`` -> ``[T, R]`` float32 (float64 for float64
    ``x``), zeros where -1."""
    out = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=torch.promote_types(x.dtype, torch.float32),
                      device=x.device)
    for t, slot in enumerate(indices.tolist()):
        if slot >= 0:
            out[t] = (scale * (lora_a[slot].double() @ x[t].double())).to(out.dtype)
    return out


def bgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor, output: torch.Tensor,
                slice_offset: int = 0, add_inputs: bool = True) -> torch.Tensor:
    """``output[t, off:off+N] (+)= y[t] @ lora_b[slot].T`` for rows with a slot; returns ``output``."""
    size = lora_b.shape[1]
    for t, slot in enumerate(indices.tolist()):
        if slot < 0:
            continue
        delta = lora_b[slot].double() @ y[t].double()
        part = output[t, slice_offset:slice_offset + size]
        value = part.double() + delta if add_inputs else delta
        output[t, slice_offset:slice_offset + size] = value.to(output.dtype)
    return output


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                seg_slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """:func:`bgmv_shrink` with each row's slot given by segments."""
    return bgmv_shrink(x, lora_a, segments_to_indices(x.shape[0], seg_starts, seg_lens, seg_slots), scale)


def sgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                seg_slots: torch.Tensor, output: torch.Tensor, slice_offset: int = 0,
                add_inputs: bool = True) -> torch.Tensor:
    """:func:`bgmv_expand` with each row's slot given by segments."""
    indices = segments_to_indices(y.shape[0], seg_starts, seg_lens, seg_slots)
    return bgmv_expand(y, lora_b, indices, output, slice_offset, add_inputs)


#: The ``"reference"`` LoRA kernel (per row, float64).
REFERENCE_KERNEL = SimpleNamespace(name="reference", bgmv_shrink=bgmv_shrink, bgmv_expand=bgmv_expand,
                                   sgmv_shrink=sgmv_shrink, sgmv_expand=sgmv_expand)
