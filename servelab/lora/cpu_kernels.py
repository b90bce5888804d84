"""The ``"cpu"`` LoRA kernel: per-row LoRA in C (``csrc/lora.c``), float32, rows grouped by slot.

Each row does only its own adapter's products (a small GEMM per slot, the slot's A and B
streamed once per call while its rows are in cache), where the ``"torch"`` path
(:mod:`servelab.lora.ops`) runs either one GEMM against every slot (slots x the products) or
a GEMM pair per slot (~10 us of fixed cost each). The four Punica-style functions have the
signatures and semantics of :mod:`servelab.reference.lora`; :func:`add_layer_deltas` does a
whole :class:`~servelab.lora.layers.LoRALinear` in one call (every slice's shrink and expand,
skipping the slices a slot's adapter leaves alone and the rank padding past its rank).

When the C path does not apply — a dtype other than float32 (float64 tests, bf16), a tensor
not on the CPU, an output whose columns are strided, or no library — every function falls
back to :mod:`servelab.lora.ops` (same results, torch arithmetic).

Built with :mod:`servelab.attention.cpu_kernel_build`'s machinery, like
:mod:`servelab.quantization.cpu_kernels` (same compiler, flag sets, resolved-target cache key,
cache folder, verification of every entry point in a child process before the library is
loaded), as a library of its own. ``SERVELAB_CPU_KERNELS=0`` disables it like the others;
:func:`library` is ``None`` when no compiler or flag set works (one warning, then the torch path).
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from servelab.attention import cpu_kernel_build as build
from servelab.lora import ops

__all__ = ["CPU_C_KERNEL", "add_layer_deltas", "bgmv_expand", "bgmv_shrink", "library", "sgmv_expand",
           "sgmv_shrink", "unavailable_reason"]

SOURCE = Path(__file__).with_name("csrc") / "lora.c"
ABI = 1
# every entry point once: 3 rows over 2 slots (one row without), both B layouts, 2 threads
_VERIFY = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.servelab_lora_build_key.restype = ctypes.c_char_p
assert lib.servelab_lora_abi() == 1 and lib.servelab_lora_build_key().decode() == sys.argv[2]
P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
lib.servelab_lora_shrink.argtypes = [P, I, I, I, P, I, I, I, I, P, P, P, P, I, F, P, I, I]
lib.servelab_lora_expand.argtypes = [P, I, I, I, P, I, I, I, I, I, P, P, P, P, I, I, P, I, I]
lib.servelab_lora_layer.argtypes = [P, I, I, I, P, I, P, I, I, I, I, I, I, P, P, P, P, P, I, I]
T, K, R, N = 3, 40, 2, 20
x = (ctypes.c_float * (T * K))(*[1.0] * (T * K))
a = (ctypes.c_float * (2 * R * K))(*([0.5] * (R * K) + [0.25] * (R * K)))
idx = (ctypes.c_int64 * T)(1, -1, 0)
h = (ctypes.c_float * (T * R))(*[9.0] * (T * R))
assert lib.servelab_lora_shrink(x, K, T, K, a, R * K, K, R, 2, idx, None, None, None, 0, 2.0, h, R, 2) == 0
assert list(h) == [0.5 * K] * R + [0.0] * R + [K * 1.0] * R, list(h)
b = (ctypes.c_float * (2 * N * R))(*[1.0] * (2 * N * R))
out = (ctypes.c_float * (T * N))(*[1.0] * (T * N))
assert lib.servelab_lora_expand(h, R, T, R, b, N * R, R, 1, N, 2, idx, None, None, None, 0, 1, out, N, 2) == 0
assert out[0] == 1 + R * 0.5 * K and out[N] == 1.0 and out[2 * N + N - 1] == 1 + R * K, list(out)
sl = (ctypes.c_int64 * 2)(0, N)
ranks = (ctypes.c_int64 * 2)(R, R)
out = (ctypes.c_float * (T * N))()
assert lib.servelab_lora_layer(x, K, T, K, a, R * K, b, N * R, R, 1, 2, R, 1, sl, ctypes.addressof(sl) + 8, ranks, idx,
                               out, N, 2) == 0
assert out[0] == R * 0.25 * K and out[N] == 0.0 and out[2 * N] == R * 0.5 * K, list(out)
assert lib.servelab_lora_layer(x, K, T, K, a, R * K, b, N * R, R, 1, 1, R, 1, sl, ctypes.addressof(sl) + 8, ranks, idx,
                               out, N, 1) == 1  # slot 1 of 1: refused
print("ok")
"""

_lock = threading.Lock()
_state: dict[str, Any] = {}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "servelab_lora_shrink": [_P, _I, _I, _I, _P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _F, _P, _I, _I],
    "servelab_lora_expand": [_P, _I, _I, _I, _P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I, _I],
    "servelab_lora_layer": [_P, _I, _I, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _I],
}


def _build() -> tuple[ctypes.CDLL | None, str]:
    lib, why = build.build_library("lora", SOURCE, ABI, "SERVELAB_LORA_BUILD_KEY", _VERIFY)
    if lib is not None:
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = ctypes.c_int
    return lib, why


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (built once per process), or ``None`` (:func:`unavailable_reason` says why)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["why"] = _build()
                if _state["lib"] is None and _state["why"] != "SERVELAB_CPU_KERNELS=0":
                    warnings.warn(f"servelab: the C LoRA kernel is unavailable ({_state['why']}); the 'cpu' LoRA "
                                  "kernel runs the torch path (servelab.lora.ops)", RuntimeWarning, stacklevel=3)
    return _state["lib"]


def unavailable_reason() -> str | None:
    """Why :func:`library` is ``None``; ``None`` when it is loaded."""
    return None if library() is not None else _state.get("why", "not built")


def _lib() -> ctypes.CDLL | None:
    lib = _state.get("lib")
    return lib if lib is not None or "lib" in _state else library()


def _on_cpu_f32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype is torch.float32 and t.device.type == "cpu" for t in tensors)


def _rows(indices: torch.Tensor, num_rows: int, name: str = "indices") -> torch.Tensor:
    """``indices`` as int64 contiguous CPU ``[num_rows]`` (the C kernel reads ``num_rows`` of them)."""
    if indices.dim() != 1 or indices.shape[0] != num_rows:
        raise ValueError(f"{name} has shape {tuple(indices.shape)}; valid: [{num_rows}] (one slot per row)")
    return indices.to(device="cpu", dtype=torch.int64).contiguous()


def _segments(seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor) -> list[torch.Tensor]:
    segs = [s.to(device="cpu", dtype=torch.int64).contiguous() for s in (seg_starts, seg_lens, seg_slots)]
    if not segs[0].dim() == segs[1].dim() == segs[2].dim() == 1 or not (segs[0].numel() == segs[1].numel()
                                                                        == segs[2].numel()):
        raise ValueError(f"seg_starts, seg_lens, seg_slots have shapes {[tuple(s.shape) for s in segs]}; "
                         "valid: three [S] tensors")
    return segs


def _check(rc: int, num_slots: int, slots: torch.Tensor, name: str) -> None:
    if rc == 1:
        bad = int(slots.max())
        raise ValueError(f"{name} holds slot {bad}; valid: -1 (no adapter) to {num_slots - 1} ({num_slots} slots)")
    if rc != 0:
        raise MemoryError("the C LoRA kernel could not allocate its row lists")


def _shrink(x: torch.Tensor, lora_a: torch.Tensor, scale: float, mapping: tuple, slots: torch.Tensor,
            name: str) -> torch.Tensor:
    x = x if x.stride(1) == 1 else x.contiguous()
    lora_a = lora_a if lora_a.stride(2) == 1 else lora_a.contiguous()
    rows, fan_in = x.shape
    num_slots, width, _ = lora_a.shape
    h = torch.empty((rows, width), dtype=torch.float32)
    if rows:
        indices, segs = mapping
        ptrs = [None, None, None] if segs is None else [s.data_ptr() for s in segs]
        rc = _lib().servelab_lora_shrink(  # type: ignore[union-attr]
            x.data_ptr(), x.stride(0), rows, fan_in, lora_a.data_ptr(), lora_a.stride(0), lora_a.stride(1), width,
            num_slots, None if indices is None else indices.data_ptr(), *ptrs, 0 if segs is None else segs[0].numel(),
            scale, h.data_ptr(), width, torch.get_num_threads())
        _check(rc, num_slots, slots, name)
    return h


def _expand(y: torch.Tensor, lora_b: torch.Tensor, output: torch.Tensor, slice_offset: int, add_inputs: bool,
            mapping: tuple, slots: torch.Tensor, name: str) -> torch.Tensor:
    y = y if y.stride(1) == 1 else y.contiguous()
    rows, rank = y.shape
    num_slots, size, _ = lora_b.shape
    if not 0 <= slice_offset <= output.shape[1] - size:
        raise ValueError(f"slice_offset={slice_offset} with {size} columns does not fit output's "
                         f"{output.shape[1]}; valid: 0 to {output.shape[1] - size}")
    if rows:
        indices, segs = mapping
        ptrs = [None, None, None] if segs is None else [s.data_ptr() for s in segs]
        rc = _lib().servelab_lora_expand(  # type: ignore[union-attr]
            y.data_ptr(), y.stride(0), rows, rank, lora_b.data_ptr(), lora_b.stride(0), lora_b.stride(1),
            lora_b.stride(2), size, num_slots, None if indices is None else indices.data_ptr(), *ptrs,
            0 if segs is None else segs[0].numel(), int(bool(add_inputs)),
            output.data_ptr() + slice_offset * output.element_size(), output.stride(0), torch.get_num_threads())
        _check(rc, num_slots, slots, name)
    return output


def _shrink_applies(x: torch.Tensor, lora_a: torch.Tensor) -> bool:
    return (x.dim() == 2 and lora_a.dim() == 3 and x.shape[1] == lora_a.shape[2] and _on_cpu_f32(x, lora_a)
            and _lib() is not None)


def _expand_applies(y: torch.Tensor, lora_b: torch.Tensor, output: torch.Tensor) -> bool:
    return (y.dim() == 2 and lora_b.dim() == 3 and output.dim() == 2 and y.shape[1] == lora_b.shape[2]
            and y.shape[0] == output.shape[0] and output.stride(1) == 1 and _on_cpu_f32(y, lora_b, output)
            and _lib() is not None)


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x [T, in]``, ``lora_a [S, R, in]``, ``indices [T]`` -> ``[T, R]`` float32 (float64 for float64
    ``x``: the torch path), zeros where -1."""
    if not _shrink_applies(x, lora_a):
        return ops.bgmv_shrink(x, lora_a, indices, scale)
    rows = _rows(indices, x.shape[0])
    return _shrink(x, lora_a, float(scale), (rows, None), rows, "indices")


def bgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor, output: torch.Tensor,
                slice_offset: int = 0, add_inputs: bool = True) -> torch.Tensor:
    """``output[t, off:off+N] (+)= y[t] @ lora_b[slot].T`` for rows with a slot; returns ``output``."""
    if not _expand_applies(y, lora_b, output):
        return ops.bgmv_expand(y, lora_b, indices, output, slice_offset, add_inputs)
    rows = _rows(indices, y.shape[0])
    return _expand(y, lora_b, output, slice_offset, add_inputs, (rows, None), rows, "indices")


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                seg_slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """:func:`bgmv_shrink` with each row's slot given by segments (rows outside them: zeros)."""
    if not _shrink_applies(x, lora_a):
        return ops.sgmv_shrink(x, lora_a, seg_starts, seg_lens, seg_slots, scale)
    segs = _segments(seg_starts, seg_lens, seg_slots)
    return _shrink(x, lora_a, float(scale), (None, segs), segs[2], "seg_slots")


def sgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                seg_slots: torch.Tensor, output: torch.Tensor, slice_offset: int = 0,
                add_inputs: bool = True) -> torch.Tensor:
    """:func:`bgmv_expand` with each row's slot given by segments."""
    if not _expand_applies(y, lora_b, output):
        return ops.sgmv_expand(y, lora_b, seg_starts, seg_lens, seg_slots, output, slice_offset, add_inputs)
    segs = _segments(seg_starts, seg_lens, seg_slots)
    return _expand(y, lora_b, output, slice_offset, add_inputs, (None, segs), segs[2], "seg_slots")


def add_layer_deltas(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     slice_table: torch.Tensor, slot_ranks: torch.Tensor, max_rank: int,
                     indices: torch.Tensor) -> bool:
    """One wrapped layer's deltas in one call: ``out[t, start_j:start_j+size_j] += B_j A_j x[t]`` for
    each slice ``j`` and row ``t`` of a slot, in place. False (nothing done) when the C path does
    not apply; the caller then runs the four kernels.

    Args:
        x: float32 ``[T, in]`` (unit column stride); out: float32 ``[T, out]`` (unit column stride).
        lora_a: ``[S, num_slices * max_rank, in]`` contiguous; lora_b: ``[S, out, max_rank]``.
        slice_table: int64 ``[2, num_slices]`` contiguous: each slice's first output column, and width.
        slot_ranks: int64 ``[S, num_slices]`` contiguous: each slot's rank in each slice (0: left alone).
        indices: int64 ``[T]`` contiguous, each row's slot (-1: none).
    """
    lib = _state.get("lib") if "lib" in _state else library()
    if (lib is None or not _on_cpu_f32(x, out, lora_a, lora_b) or x.stride(1) != 1 or out.stride(1) != 1
            or not lora_a.is_contiguous() or indices.dtype is not torch.int64 or not indices.is_contiguous()):
        return False
    rows, fan_in = x.shape
    num_slots, num_slices = slot_ranks.shape
    if indices.shape != (rows,) or out.shape[0] != rows or lora_a.shape[0] != num_slots:
        raise ValueError(f"indices {tuple(indices.shape)}, out {tuple(out.shape)}, lora_a {tuple(lora_a.shape)} and "
                         f"slot_ranks {tuple(slot_ranks.shape)} disagree; valid: indices [{rows}], out [{rows}, N], "
                         f"lora_a [{num_slots}, W, {fan_in}]")
    starts = slice_table.data_ptr()
    rc = lib.servelab_lora_layer(x.data_ptr(), x.stride(0), rows, fan_in, lora_a.data_ptr(), lora_a.stride(0),
                                 lora_b.data_ptr(), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), num_slots,
                                 max_rank, num_slices, starts, starts + 8 * num_slices, slot_ranks.data_ptr(),
                                 indices.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads())
    _check(rc, num_slots, indices, "indices")
    return True


#: The ``"cpu"`` LoRA kernel: C for float32 on the CPU, else the ``"torch"`` path.
CPU_C_KERNEL = SimpleNamespace(name="cpu", bgmv_shrink=bgmv_shrink, bgmv_expand=bgmv_expand, sgmv_shrink=sgmv_shrink,
                               sgmv_expand=sgmv_expand, add_layer_deltas=add_layer_deltas)
