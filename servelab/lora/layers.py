"""``LoRALinear``: any :class:`~servelab.models.layer_api.LinearLayer` with per-slot adapters
(vLLM's ``BaseLayerWithLoRA``).

The wrapped layer runs as it is (dense, quantized or sharded), then each row
gets its adapter's delta added: ``out[t] += B_s (A_s x[t])`` for the slot ``s``
of row ``t`` (rows of slot ``-1`` are the base model). The slots' weights live
in two stacked buffers per wrapped layer, written by the adapter manager when
it activates an adapter (:mod:`servelab.lora.manager`):

- ``lora_a``: ``[max_loras, num_slices * max_rank, in_features]``; slice ``j``'s
  A in rows ``j * max_rank ..``, zero-padded past the adapter's rank;
- ``lora_b``: ``[max_loras, out_features, max_rank]``; output rows of slice
  ``j`` (e.g. ``k_proj``'s rows of a fused ``qkv_proj``) hold that module's
  ``B * scaling``, zero where the adapter leaves the module alone. On a CPU its
  storage is ``[max_loras, max_rank, out_features]`` (a transposed view, output
  columns contiguous: what the C kernel's expand reads); kernels use its strides.

One shrink gives every slice's ``A x`` at once (``[T, num_slices * max_rank]``);
one expand per slice adds its ``B`` block at the slice's output offset. A kernel
that has ``add_layer_deltas`` (the ``"cpu"`` kernel, :mod:`servelab.lora.cpu_kernels`)
does all of it in one call instead, reading ``slice_table`` (each slice's output
columns) and ``slot_ranks`` (each slot's rank per slice, 0 where its adapter
leaves the slice alone: those products and the rank padding are skipped).

Which slot each row uses comes from the :class:`LoRAStepState` shared by all
wrapped layers of a model: the runner sets its mapping before the forward and
clears it after (a forward with no mapping set — a drafter reusing the
target's layers — adds nothing: drafts are only proposals, verification runs
with the adapters).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from servelab.lora.kernels import LoRAMapping
from servelab.models.layer_api import OutputSlice, dense_weight, output_slices

__all__ = ["LoRALinear", "LoRAStepState"]


def _b_buffer(slots: int, out_features: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros ``[slots, out_features, rank]``; on a CPU stored ``[slots, rank, out_features]`` (a
    transposed view: every kernel addresses B by its strides, and ``.to()`` keeps them). Why: the C
    kernel's expand multiplies 16 contiguous output columns at a time; B in the plain layout must
    be transposed on every call first (~2/3 of a decode step's expand on SmolLM2)."""
    if device.type != "cpu":
        return torch.zeros((slots, out_features, rank), dtype=dtype, device=device)
    return torch.zeros((slots, rank, out_features), dtype=dtype, device=device).transpose(1, 2)


class LoRAStepState:
    """What every wrapped layer of one model reads in a forward: the mapping and the kernel.

    Attributes:
        mapping: this forward's :class:`~servelab.lora.kernels.LoRAMapping`, or None.
        kernel: the LoRA kernel object (see :mod:`servelab.lora.kernels`).
    """

    def __init__(self, kernel: Any) -> None:
        self.mapping: LoRAMapping | None = None
        self.kernel = kernel


class LoRALinear(nn.Module):
    """``base`` plus per-row adapter deltas (see the module docstring).

    Args:
        base: the layer wrapped (a :class:`~servelab.models.layer_api.LinearLayer`).
        name: its qualified module name (``"model.layers.0.self_attn.qkv_proj"``).
        max_loras, max_rank: the slots and their width.
        state: the model's shared :class:`LoRAStepState`.
        dtype: of the buffers (the model's).
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    slot_ranks: torch.Tensor
    slice_table: torch.Tensor

    def __init__(self, base: nn.Module, name: str, *, max_loras: int, max_rank: int, state: LoRAStepState,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        self.in_features: int = int(getattr(base, "in_features"))
        self.out_features: int = int(getattr(base, "out_features"))
        self.qualified_name = name
        prefix, _, last = name.rpartition(".")
        self.slices: tuple[OutputSlice, ...] = output_slices(base, last)
        self.hf_names = [f"{prefix}.{s.name}" if prefix else s.name for s in self.slices]
        self.max_rank = max_rank
        self.state = state
        declared = getattr(base, "output_slices", None)
        if declared:  # a fused layer stays one to layer_api (its parts' HF names)
            object.__setattr__(self, "output_slices", tuple(declared))
        device = dense_weight(base).device
        width = len(self.slices) * max_rank
        self.register_buffer("lora_a", torch.zeros((max_loras, width, self.in_features), dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", _b_buffer(max_loras, self.out_features, max_rank, dtype, device),
                             persistent=False)
        # which slices each slot's adapter adapts (a q/v-only adapter leaves o_proj and the MLP
        # alone: a step whose adapters all leave this layer alone skips it)
        self.slot_slices: list[tuple[bool, ...]] = [(False,) * len(self.slices)] * max_loras
        # the same, with each adapter's rank, and the slices' output columns, for a fused kernel
        self.register_buffer("slot_ranks", torch.zeros((max_loras, len(self.slices)), dtype=torch.int64,
                                                       device=device), persistent=False)
        self.register_buffer("slice_table", torch.tensor([[p.start for p in self.slices],
                                                          [p.size for p in self.slices]], dtype=torch.int64,
                                                         device=device), persistent=False)

    def dense_weight(self) -> torch.Tensor:
        """The base layer's float ``[out, in]`` weight (adapters are per row, not in it)."""
        return dense_weight(self.base)

    @property
    def bias(self) -> Any:
        return getattr(self.base, "bias", None)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter into ``slot`` (``weights``: HF module name -> (A ``[r, in]``,
        B*scaling ``[out, r]``), the modules it does not name zeroed)."""
        a_rows = torch.zeros_like(self.lora_a[slot])
        b_rows = torch.zeros_like(self.lora_b[slot])
        r_max = self.max_rank
        for j, (part, hf_name) in enumerate(zip(self.slices, self.hf_names)):
            pair = weights.get(hf_name)
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            a_rows[j * r_max:j * r_max + r] = a.to(a_rows.dtype)
            b_rows[part.start:part.start + part.size, :r] = b.to(b_rows.dtype)
        self.lora_a[slot].copy_(a_rows)
        self.lora_b[slot].copy_(b_rows)
        self.slot_slices[slot] = tuple(name in weights for name in self.hf_names)
        ranks = [weights[name][0].shape[0] if name in weights else 0 for name in self.hf_names]
        self.slot_ranks[slot].copy_(torch.tensor(ranks, dtype=torch.int64))

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slot_slices[slot] = (False,) * len(self.slices)
        self.slot_ranks[slot].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in_features]`` -> ``[T, out_features]``: the base output plus each row's delta."""
        out = self.base(x)
        mapping = self.state.mapping
        if mapping is None or not mapping.any_adapter:
            return out
        if x.shape[0] != mapping.num_tokens:
            raise RuntimeError(f"LoRA layer {self.qualified_name}: {x.shape[0]} rows but the step's LoRA mapping "
                               f"has {mapping.num_tokens}; set the mapping for each forward")
        kernel = self.state.kernel
        fused = getattr(kernel, "add_layer_deltas", None)
        if fused is not None and fused(x, out, self.lora_a, self.lora_b, self.slice_table, self.slot_ranks,
                                       self.max_rank, mapping.indices):
            return out
        # slices some adapter of this step adapts (all zero B otherwise: nothing to add)
        used = [any(self.slot_slices[s][j] for s in mapping.slots) for j in range(len(self.slices))]
        if not any(used):
            return out
        r_max = self.max_rank
        if mapping.decode:
            h = kernel.bgmv_shrink(x, self.lora_a, mapping.indices, 1.0)
            for j, part in enumerate(self.slices):
                if used[j]:
                    kernel.bgmv_expand(h[:, j * r_max:(j + 1) * r_max],
                                       self.lora_b[:, part.start:part.start + part.size], mapping.indices, out,
                                       part.start, True)
        else:
            segs = (mapping.seg_starts, mapping.seg_lens, mapping.seg_slots)
            h = kernel.sgmv_shrink(x, self.lora_a, *segs, 1.0)
            for j, part in enumerate(self.slices):
                if used[j]:
                    kernel.sgmv_expand(h[:, j * r_max:(j + 1) * r_max],
                                       self.lora_b[:, part.start:part.start + part.size], *segs, out, part.start, True)
        return out
