"""The LoRA kernel seam: an interface, a registry, and the step's row -> slot mapping.

A LoRA kernel is any object with the four Punica-style functions (signatures
and semantics in :mod:`servelab.reference.lora`): ``sgmv_shrink`` /
``sgmv_expand`` (prefill: rows grouped in segments, one adapter per segment)
and ``bgmv_shrink`` / ``bgmv_expand`` (decode: one adapter index per row),
with slice offsets for fused projections and ``-1`` for rows without an
adapter. Registered names:

- ``"cpu"``: the CPU fast path, per-row LoRA in C for float32 (rows grouped by slot, one
  call per wrapped layer: :mod:`servelab.lora.cpu_kernels`), the ``"torch"`` path for
  other dtypes or when the C library cannot be built;
- ``"torch"``: grouped dense GEMMs in torch (:mod:`servelab.lora.ops`), any dtype;
- ``"triton"``: Triton kernels (:mod:`servelab.kernels.lora`; on a CPU only
  under ``TRITON_INTERPRET=1``);
- ``"reference"``: the per-row float64 spec (:mod:`servelab.reference.lora`).

``"auto"`` (the default) is ``"triton"`` on CUDA and ``"cpu"`` elsewhere.

A kernel may also have ``add_layer_deltas(x, out, lora_a, lora_b, slice_table, slot_ranks,
max_rank, indices) -> bool`` (see :func:`servelab.lora.cpu_kernels.add_layer_deltas`): a
whole wrapped layer's deltas in one call; :class:`~servelab.lora.layers.LoRALinear` tries it
first and runs the four functions when it returns False.
Swap it like any piece: ``register_lora_kernel("mine", my_ops)`` then
``Pipeline(..., enable_lora=True)`` and ``pipe.lora_manager.kernel = "mine"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from servelab._internal.registry import Registry

__all__ = ["LoRAKernel", "LoRAMapping", "available_lora_kernels", "get_lora_kernel", "register_lora_kernel"]


@runtime_checkable
class LoRAKernel(Protocol):
    """The four LoRA kernels (see :mod:`servelab.reference.lora` for shapes)."""

    def bgmv_shrink(self, x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor,
                    scale: float = 1.0) -> torch.Tensor: ...

    def bgmv_expand(self, y: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor, output: torch.Tensor,
                    slice_offset: int = 0, add_inputs: bool = True) -> torch.Tensor: ...

    def sgmv_shrink(self, x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                    seg_slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor: ...

    def sgmv_expand(self, y: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                    seg_slots: torch.Tensor, output: torch.Tensor, slice_offset: int = 0,
                    add_inputs: bool = True) -> torch.Tensor: ...


_METHODS = ("bgmv_shrink", "bgmv_expand", "sgmv_shrink", "sgmv_expand")


def _check(obj: Any) -> None:
    missing = [m for m in _METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise TypeError(f"LoRA kernel {obj!r} lacks {', '.join(missing)} (a LoRA kernel provides "
                        f"{', '.join(_METHODS)}; see servelab.reference.lora)")


_REGISTRY: Registry[Any] = Registry("LoRA kernel", check=_check)
_REGISTRY.register("cpu", "servelab.lora.cpu_kernels:CPU_C_KERNEL")
_REGISTRY.register("torch", "servelab.lora.ops:CPU_KERNEL")
_REGISTRY.register("triton", "servelab.kernels.lora:TRITON_KERNEL")
_REGISTRY.register("reference", "servelab.reference.lora:REFERENCE_KERNEL")


def register_lora_kernel(name: str, obj: Any, *, override: bool = False) -> None:
    """Register a LoRA kernel (an object with the four functions, or a lazy ``"module:attr"``)."""
    _REGISTRY.register(name, obj, override=override)


def available_lora_kernels() -> list[str]:
    return _REGISTRY.available()


def get_lora_kernel(name_or_obj: Any, device: torch.device | str = "cpu") -> Any:
    """A registered kernel by name (``"auto"``: ``"triton"`` on CUDA, else ``"cpu"``), or a
    kernel object checked and returned as it is."""
    if name_or_obj == "auto":
        name_or_obj = "triton" if torch.device(device).type == "cuda" else "cpu"
    if isinstance(name_or_obj, str):
        kernel = _REGISTRY.lookup(name_or_obj)
        _check(kernel)
        return kernel
    _check(name_or_obj)
    return name_or_obj


@dataclass
class LoRAMapping:
    """Which slot each row of one forward uses (built by the runner once per step).

    Attributes:
        num_tokens: ``T``, the forward's rows.
        indices: int64 ``[T]``, each row's slot (``-1``: no adapter).
        seg_starts, seg_lens, seg_slots: int64 ``[S]``: the rows as runs of one
            slot (a request's rows are contiguous), for the SGMV kernels.
        decode: every request has one row (BGMV is used, else SGMV).
        any_adapter: some row has a slot (else the wrappers add nothing).
        slots: the distinct slots the rows use (a layer none of them adapts is skipped).
    """

    num_tokens: int
    indices: torch.Tensor
    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    seg_slots: torch.Tensor
    decode: bool
    any_adapter: bool
    slots: tuple[int, ...] = ()

    @classmethod
    def from_requests(cls, slots: list[int], num_rows: list[int], device: torch.device | str = "cpu"
                      ) -> LoRAMapping:
        """From each request's slot (``-1``: none) and row count, in batch order; adjacent
        requests on the same slot are merged into one segment."""
        starts: list[int] = []
        lens: list[int] = []
        seg_slots: list[int] = []
        row = 0
        for slot, n in zip(slots, num_rows):
            if seg_slots and seg_slots[-1] == slot:
                lens[-1] += n
            else:
                starts.append(row)
                lens.append(n)
                seg_slots.append(slot)
            row += n
        indices = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64), torch.tensor(num_rows))

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        used = tuple(sorted({s for s in slots if s >= 0}))
        return cls(row, indices.to(device), tensor(starts), tensor(lens), tensor(seg_slots),
                   decode=all(n == 1 for n in num_rows), any_adapter=bool(used), slots=used)
