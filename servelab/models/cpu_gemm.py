"""A float32 GEMM for a few rows on a CPU (``csrc/panel_gemm.c``); ``F.linear`` is the reference.

Why: a decode step multiplies a few rows by every weight of the model, so its
GEMMs stream the weights from memory. ``bench/cpu_gemm.py`` (a whole decoder
forward's GEMMs, weights cold as in a step) on a 2-core AMD EPYC (Zen 4), one
thread, medians in ms (the AVX-512 build; the AVX2 build's measurements are in
``csrc/panel_gemm.c``'s header):

=====================  ====  ============  ==============  ======  ==========
weights                rows  ``F.linear``  oneDNN packed   panels  read floor
=====================  ====  ============  ==============  ======  ==========
tiny (hidden 256)      1     1.27          0.91            0.44    0.23
tiny                   16    2.42          1.52            1.29    0.21
tiny                   32    3.43          2.40            1.96    0.19
tiny                   64    6.63          4.76            4.59    0.27
SmolLM2-135M layers    1     38.3          33.2            18.7    18.2
SmolLM2-135M layers    16    102.1         60.8            53.3    19.5
SmolLM2-135M layers    32    154.8         96.9            90.7    19.4
SmolLM2-135M layers    64    270.2         177.4           167.3   20.2
=====================  ====  ============  ==============  ======  ==========

At 64 rows the two tie on the tiny model (and oneDNN wins at 2 threads), and
oneDNN's blocking wins at hundreds of rows (by 12-35% at 128-512 rows against
this kernel's first, 4-row-block version), so
:mod:`servelab.models.linear` sends at most :data:`MAX_ROWS` rows here.

Layout: :func:`pack` arranges a weight ``[N, K]`` once into panels of ``W``
output columns ``[ceil(N / W), K, W]`` (zero past ``N``), each panel one
sequential stream. ``W`` is the loaded build's (:func:`panel_width`): 64 on
AVX-512, 16 elsewhere, so that 6 rows' accumulators fit the vector registers.

Numerics: every output sums its ``K`` products in increasing ``k`` in one
float32 lane, then adds the bias, so a row's result is the same bits in any
batch and at any thread count (batch-invariant), and within the float32 bound
of a ``K``-term dot product of the float64 result
(``tests/models/test_cpu_gemm.py``). It differs from ``F.linear`` in the last
bits, as oneDNN's packed GEMM does.

Who calls what: :func:`servelab.models.linear.linear` asks :func:`preferred`
(AVX-512 and AVX2 + FMA builds) and :func:`usable`, packs once per weight
(:class:`~servelab.models.linear.PackedWeight`) and calls :func:`_gemm`;
``SERVELAB_CPU_KERNELS=0`` (read at the first call in a process,
:class:`servelab.attention.cpu_decode.LibraryOnce`) keeps ``F.linear`` / oneDNN.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from servelab.attention import cpu_decode

#: output columns per panel when no kernel library is loaded (the AVX-512 build's); a loaded
#: library says its own (:func:`panel_width`, csrc/panel_gemm.c's PANEL).
FALLBACK_PANEL = 64
#: most rows sent to the kernel by :func:`servelab.models.linear.linear` (see the table above).
MAX_ROWS = 32

_library = cpu_decode.LibraryOnce()  # the hot path calls _library.lib
_traits: tuple[Any, bool, int] | None = None  # (library, preferred(), panel width) once asked


def _library_traits() -> tuple[Any, bool, int] | None:
    """``(library, preferred, panel width)`` of the loaded library, asked once per library
    object (a test that swaps ``_library`` gets the new library's answers), or ``None``."""
    global _traits
    lib = _library()
    if lib is None:
        return None
    if _traits is None or _traits[0] is not lib:
        width = lib["servelab_panel_gemm_width"]  # a fresh function object: the shared one keeps its restype
        width.argtypes, width.restype = [], ctypes.c_int64
        _traits = (lib, bool(lib.servelab_panel_gemm_preferred()), int(width()))
    return _traits


def panel_width() -> int:
    """Output columns per panel of the loaded library's build (64 on AVX-512, where 4 vectors of
    16 floats x 6 rows fit the 32 registers; 16 elsewhere, 2 vectors of 8), :data:`FALLBACK_PANEL`
    without a library."""
    traits = _library_traits()
    return FALLBACK_PANEL if traits is None else traits[2]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` float32 -> panels ``[ceil(N / W), K, W]`` with ``W = panel_width()``
    (a contiguous float32 copy, zero past ``N``)."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.dtype is not torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"weight (shape {tuple(weight.shape)}, {weight.dtype}, {weight.device}) must be a "
                         "2-D float32 CPU tensor [out_features, in_features]")
    out_features, in_features = weight.shape
    width = panel_width()
    n_panels = -(-out_features // width)
    padded = weight.detach().new_zeros(n_panels * width, in_features)
    padded[:out_features] = weight.detach()
    return padded.view(n_panels, width, in_features).transpose(1, 2).contiguous()


def preferred() -> bool:
    """Whether :func:`servelab.models.linear.linear` should route few rows here (csrc/panel_gemm.c's
    ``servelab_panel_gemm_preferred``: builds where the kernel measured faster than oneDNN).
    Elsewhere oneDNN / ``F.linear`` keep every row count; :func:`gemm` still computes correctly."""
    traits = _library_traits()
    return traits is not None and traits[1]


def usable(x: torch.Tensor) -> bool:
    """Whether :func:`gemm` handles the input ``x``: a float32 CPU ``[rows, K]`` with ``K``
    contiguous, autograd not recording, and the kernel library built."""
    return (x.dtype is torch.float32 and x.dim() == 2 and x.is_cpu  # is_cpu: no device object (hot path)
            and (x.stride(1) == 1 or x.shape[1] <= 1)  # a dimension of size 0 or 1 has no meaningful stride
            and not (torch.is_grad_enabled() and x.requires_grad) and _library() is not None)


def gemm(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``panels = pack(weight)``: x ``[rows, K]`` ->
    a new contiguous ``[rows, out_features]`` float32. Raises ``TypeError`` / ``ValueError``
    naming the arguments when they do not fit together or :func:`usable` refuses ``x``."""
    for name, value in (("x", x), ("panels", panels)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a tensor or None, got {type(bias).__name__}")
    if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features < 1:
        raise ValueError(f"out_features must be a positive int, got {out_features!r}")
    if not usable(x):
        raise ValueError(f"x (shape {tuple(x.shape)}, strides {x.stride()}, {x.dtype}) must be a float32 CPU "
                         "[rows, K] with K contiguous, outside autograd, and the kernel library built")
    width = panel_width()
    expected = (-(-out_features // width), x.shape[1], width)
    if (tuple(panels.shape) != expected or panels.dtype is not torch.float32 or panels.device.type != "cpu"
            or not panels.is_contiguous()):
        raise ValueError(f"panels (shape {tuple(panels.shape)}, {panels.dtype}) must be pack(weight) of a "
                         f"[{out_features}, {x.shape[1]}] float32 weight: contiguous {expected}")
    if bias is not None and (tuple(bias.shape) != (out_features,) or bias.dtype is not torch.float32
                             or bias.device.type != "cpu" or not bias.is_contiguous()):
        raise ValueError(f"bias (shape {tuple(bias.shape)}, {bias.dtype}) must be a contiguous float32 CPU "
                         f"[{out_features}] or None")
    return _gemm(x, panels, bias, out_features)


def _gemm(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """:func:`gemm` unchecked (:func:`servelab.models.linear.linear`'s hot path, after :func:`usable`)."""
    rows, in_features = x.shape
    out = torch.empty(rows, out_features, dtype=torch.float32, device="cpu")
    if rows:
        _library.lib.servelab_panel_gemm(x.data_ptr(), x.stride(0), panels.data_ptr(),
                                         None if bias is None else bias.data_ptr(), out.data_ptr(), rows,
                                         in_features, out_features, torch.get_num_threads())
    return out
