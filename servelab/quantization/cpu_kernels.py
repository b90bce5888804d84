"""The C CPU kernels of quantized weights (``csrc/quant_gemm.c``): a few-row GEMM over packed
weights and a GGUF row gather (the embedding lookup), neither materializing the float weight.

Built with :mod:`servelab.attention.cpu_kernel_build`'s machinery (same compiler, flag sets,
resolved-target cache key, cache folder, verification of every entry point in a child process
before the library is loaded), as a library of its own so the quantization piece can change its
source without rebuilding the attention kernels. ``SERVELAB_CPU_KERNELS=0`` disables it like the
others. :func:`library` is ``None`` when no compiler or flag set works; the layers then run their
reference with one warning (:mod:`servelab.quantization.layer`).

Format codes (the ``fmt`` argument): see :data:`FORMAT_CODES`.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import torch

from servelab.attention import cpu_kernel_build as build

SOURCE = Path(__file__).with_name("csrc") / "quant_gemm.c"
ABI = 1
MAX_ROWS = 32
#: packed format -> the kernel's ``fmt`` code
FORMAT_CODES: dict[str, int] = {"int8": 0, "w4a16": 1, "Q8_0": 2, "Q4_0": 3, "Q4_1": 4, "Q5_0": 5, "Q4_K": 6,
                                "Q6_K": 7}
#: the GGUF block formats: a row holds its own scales, so ``servelab_quant_rows`` decodes any row alone
GGUF_CODES = frozenset(code for name, code in FORMAT_CODES.items() if name.startswith("Q"))
_VERIFY = r"""
import ctypes, struct, sys
lib = ctypes.CDLL(sys.argv[1])
lib.servelab_quant_build_key.restype = ctypes.c_char_p
assert lib.servelab_quant_abi() == 1 and lib.servelab_quant_build_key().decode() == sys.argv[2]
P, I = ctypes.c_void_p, ctypes.c_int64
lib.servelab_quant_gemm.argtypes = [I, P, I, I, I, I, P, I, P, P, I, P, P, I]
lib.servelab_quant_rows.argtypes = [I, P, I, I, P, I, P]
K, N, rows = 64, 70, 3
x = (ctypes.c_float * (rows * K))(*[1.0] * (rows * K))
out = (ctypes.c_float * (rows * N))()
block = struct.pack('<e', 0.5) + bytes([0x11] * 32)   # Q8_0: d = 0.5, q = 17
w = (ctypes.c_uint8 * (N * 2 * 34)).from_buffer_copy(block * (2 * N))
lib.servelab_quant_gemm(2, x, K, rows, K, N, w, 68, None, None, 0, None, out, 2)
assert abs(out[0] - 0.5 * 17 * K) < 1e-3 and abs(out[rows * N - 1] - 0.5 * 17 * K) < 1e-3, out[0]
got = (ctypes.c_float * (2 * K))()
lib.servelab_quant_rows(2, w, 68, K, (ctypes.c_int64 * 2)(0, N - 1), 2, got)
assert got[0] == 8.5 and got[2 * K - 1] == 8.5, got[0]
print("ok")
"""

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _build() -> tuple[ctypes.CDLL | None, str]:
    lib, why = build.build_library("quant_gemm", SOURCE, ABI, "SERVELAB_QUANT_BUILD_KEY", _VERIFY)
    if lib is not None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.servelab_quant_gemm.argtypes = [i, p, i, i, i, i, p, i, p, p, i, p, p, i]
        lib.servelab_quant_gemm.restype = None
        lib.servelab_quant_rows.argtypes = [i, p, i, i, p, i, p]
        lib.servelab_quant_rows.restype = None
    return lib, why


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (built once per process), or ``None`` (:func:`unavailable_reason` says why)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["why"] = _build()
    return _state["lib"]


def unavailable_reason() -> str | None:
    """Why :func:`library` is ``None``; ``None`` when it is loaded."""
    return None if library() is not None else _state.get("why", "not built")


def quant_gemm(code: int, x: torch.Tensor, weight: torch.Tensor, row_bytes: int, out_features: int,
               scales: torch.Tensor | None, zeros: torch.Tensor | None, group: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """Unchecked kernel call (the layer checks): ``x`` float32 CPU ``[rows <= 32, K]`` with ``K``
    contiguous; ``weight`` the packed rows (contiguous, ``row_bytes`` each) -> float32 ``[rows, N]``."""
    rows, in_features = x.shape
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if rows:
        library().servelab_quant_gemm(  # type: ignore[union-attr]
            code, x.data_ptr(), x.stride(0), rows, in_features, out_features, weight.data_ptr(), row_bytes,
            None if scales is None else scales.data_ptr(), None if zeros is None else zeros.data_ptr(), group,
            None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def gather_rows(code: int, blocks: torch.Tensor, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 CPU ``[n]``, in range) of a GGUF-blocked table dequantized: float32 ``[n, K]``."""
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), in_features, dtype=torch.float32)
    if ids.numel():
        library().servelab_quant_rows(code, blocks.data_ptr(), blocks.stride(0),  # type: ignore[union-attr]
                                      in_features, ids.data_ptr(), ids.numel(), out.data_ptr())
    return out
