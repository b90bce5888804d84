"""A C kernel for decode attention on a CPU, built with the system compiler.

The ``"sdpa"`` backend's carried decode path (:mod:`servelab.attention.decode_kv`)
spends most of its attention time in two skinny products per KV head,
``[G, D] x [D, len]`` and ``[G, len] x [len, D]``. ``torch.bmm`` runs them
through batched BLAS, which on these shapes reads the context from memory at a
fraction of the machine's copy bandwidth (SmolLM2-135M, 16 sequences of ~160
tokens, data cold as it is in a real step: ~250 us per product and layer for
~2 MB). ``csrc/decode_attention.c`` loads every K and V element once, in
address order, into vector registers and reuses it for the ``G`` query heads
of its group: ~150 us for the scores, ~130 us for the values (one thread).
:func:`attend` runs scores, softmax and values of each head back to back in
one parallel region (one team wake-up per layer instead of three, and the
head's scores still in cache for its values); its softmax is the kernel's
own (a polynomial ``exp``, within 2 ulp of ``expf``), so it differs from
``torch.softmax`` in the last bits, like any other summation order.

Threads. Both products split the heads (sequences x KV heads) into
contiguous ranges of equal work, one per thread, with OpenMP when the
compiler has it; the thread count is ``torch.get_num_threads()`` at each
call (the library shares torch's OpenMP runtime, so torch's threads and the
kernel's are the same threads: no oversubscription). Every head is computed
by one thread in a fixed order, so results are bit-identical for any thread
count.

Build (:mod:`servelab.attention.cpu_kernel_build`): compiled once per
machine into the cache, keyed by the compiler's *resolved* target features,
verified in a child process before the first load in a process; done when a
pipeline with the ``"sdpa"`` backend is constructed, or ahead of time with
``servelab build-kernels``. No compiler, a failed build or verification, or
``SERVELAB_CPU_KERNELS=0`` in the environment: :func:`available` is False
(with one warning, for a failed build) and the torch formulation runs
instead; results differ only in float rounding (both are checked against
float64).

Scope: float32, contiguous CPU tensors, ``head_size % 16 == 0``,
``1 <= group <= 8``.

Interface. :func:`decode_scores` and :func:`decode_pv` check their
arguments. :func:`attend` (with its ``append`` rows) is the decode path's
interface (:class:`servelab.attention.decode_kv.DecodeKV`): they trust their
caller, which built every tensor itself and range-checks the new rows' cache
slots once per step, because per-layer checks would cost more than the
kernel saves.
"""

from __future__ import annotations

import functools
import os
import warnings

from typing import Any

import torch

from servelab._internal.attention_checks import _positive_finite, _require_ndim, _require_tensor
from servelab._internal.validation import check_int
from servelab.attention import cpu_kernel_build
from servelab.attention.cpu_kernel_build import KernelBuildError

ENV_SWITCH = "SERVELAB_CPU_KERNELS"
LANES = 16
MAX_GROUP = 8

_warned = False


def supports(dtype: torch.dtype, head_size: int, group: int, device: torch.device) -> bool:
    """Whether the kernel handles these shapes (and is built and enabled)."""
    return (device.type == "cpu" and dtype == torch.float32 and head_size % LANES == 0
            and 1 <= group <= MAX_GROUP and available())


def available() -> bool:
    """The kernel is enabled (``SERVELAB_CPU_KERNELS`` is not ``0``), built and verified;
    builds on the first call in a process (one warning if that fails)."""
    return library() is not None


def library():
    """The loaded CPU kernel library (a ``ctypes.CDLL``: decode attention, RMSNorm, RoPE, the
    few-row GEMM) when :func:`available`, else ``None``."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    return _library()


@functools.lru_cache(maxsize=256)
def int64s(values: tuple[int, ...]) -> torch.Tensor:
    """``values`` as an int64 tensor the kernels read (strides), made once per distinct tuple: a
    layer's call passes the same strides as the last one, and ``torch.tensor`` was ~4 us of it.
    Never written."""
    return torch.tensor(values, dtype=torch.int64)


class LibraryOnce:
    """:func:`library` looked up at the first call, then kept in :attr:`lib` (``None``: unavailable):
    what a hot path calls through (``SERVELAB_CPU_KERNELS`` is read at that first call)."""

    __slots__ = ("lib", "checked")

    def __init__(self) -> None:
        self.lib: Any = None
        self.checked = False

    def __call__(self) -> Any:
        if not self.checked:
            self.lib, self.checked = library(), True
        return self.lib


def _library():
    global _warned
    try:
        return cpu_kernel_build.load().library
    except KernelBuildError as error:
        if not _warned:
            _warned = True
            warnings.warn(f"servelab: the C CPU kernels (decode attention, RMSNorm, RoPE, few-row GEMM) are "
                          f"unavailable ({error}); using the torch formulations. Set {ENV_SWITCH}=0 to skip the "
                          "build.", RuntimeWarning, stacklevel=4)
        return None


def uses_openmp() -> bool:
    """Whether the loaded kernel runs its heads on several threads (built with OpenMP)."""
    return available() and cpu_kernel_build.load().openmp


# ---- layouts --------------------------------------------------------------------------------

def tile_keys(keys: torch.Tensor) -> torch.Tensor:
    """K rows ``[H, cap, D]`` -> the kernel's tiled layout ``[H, cap/16, D, 16]`` (a copy).

    Position ``l``, dimension ``d`` of head ``h`` sits at ``[h, l // 16, d, l % 16]``."""
    heads, cap, head_size = keys.shape
    return keys.view(heads, cap // LANES, LANES, head_size).transpose(2, 3).contiguous()


def tiled_index(heads: torch.Tensor, position: torch.Tensor, cap: int, head_size: int) -> torch.Tensor:
    """Flat element indices of position ``position[i]`` of head ``heads[i]`` (all ``D``
    dimensions) in a tiled K buffer ``[H, cap/16, D, 16]``: int64 ``[len(heads) * D]``."""
    d = torch.arange(head_size, device=heads.device)
    base = heads * cap * head_size + (position // LANES) * head_size * LANES + position % LANES
    return (base[:, None] + d[None, :] * LANES).flatten()


# ---- kernels --------------------------------------------------------------------------------

def _scores(q: torch.Tensor, row_stride: int, group: int, tiles: torch.Tensor, lens: torch.Tensor,
            kv_per_row: int, width: int, scale: float) -> torch.Tensor:
    """Unchecked :func:`decode_scores`. ``q``: the ``kv_per_row * group`` query heads of each
    of the ``lens.shape[0]`` rows, ``row_stride`` elements apart (heads and dimensions
    contiguous): a contiguous ``[H, G, D]``, or a fused QKV output's query slice ``[rows, Hq, D]``."""
    heads, head_size = tiles.shape[0], tiles.shape[2]
    out = torch.empty(heads, group, width, dtype=torch.float32, device="cpu")
    _library().servelab_decode_scores(q.data_ptr(), row_stride, tiles.data_ptr(), lens.data_ptr(), out.data_ptr(),
                                      heads, kv_per_row, group, head_size, tiles.shape[1] * LANES, width, scale,
                                      torch.get_num_threads())
    return out


def _pv(p: torch.Tensor, values: torch.Tensor, lens: torch.Tensor, kv_per_row: int) -> torch.Tensor:
    heads, group, width = p.shape
    out = torch.empty(heads, group, values.shape[-1], dtype=p.dtype, device="cpu")
    _library().servelab_decode_pv(p.data_ptr(), values.data_ptr(), lens.data_ptr(), out.data_ptr(), heads,
                                  kv_per_row, group, values.shape[-1], values.shape[1], width,
                                  torch.get_num_threads())
    return out


def attend(q: torch.Tensor, tiles: torch.Tensor, values: torch.Tensor, lens: torch.Tensor, kv_per_row: int,
           width: int, scale: float,
           append: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode attention of every row's query heads over its first ``lens`` positions (unchecked:
    the caller guarantees the layout; :func:`decode_scores` / :func:`decode_pv` are the checked ops).

    Args:
        q: float32, ``[rows, kv_per_row * G, D]`` with heads and dimensions contiguous and rows
            any stride (a fused QKV output's query slice is read in place);
        tiles: float32 ``[H, cap/16, D, 16]`` (:func:`tile_keys`), ``H = rows * kv_per_row``;
        values: float32 ``[H, cap, D]``; lens: int64 ``[rows]``, ``1 <= lens <= width <= cap``;
        width: score columns (the longest length); scale: softmax scale;
        append: ``(key_rows, value_rows, slots)``: the flattened paged caches ``[slots, Hk, D]``
            (float32, contiguous) and int64 ``[rows]`` cache slots, in range (unchecked), of
            each row's newest position ``lens - 1``. Each head first copies that position into
            ``tiles`` / ``values``, inside the kernel, by the thread that attends the head next:
            on every thread, and into the lines the head's scores read right after (one K
            position spans ``D`` lines of the tiled layout). ``None``: the buffers already
            hold every position.

    Returns: float32 ``[H, G, D]``.
    """
    rows = (None, None, None) if append is None else (append[0].data_ptr(), append[1].data_ptr(),
                                                      append[2].data_ptr())
    return _decode_attention(q, tiles, values, lens, kv_per_row, tiles.shape[1] * LANES, width, scale, rows)


def attend_rows(q: torch.Tensor, tiles: torch.Tensor, values: torch.Tensor, lens: torch.Tensor, kv_per_row: int,
                cap: int, width: int, scale: float, key_cache: torch.Tensor, value_cache: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
    """:func:`attend` with its ``append`` from contiguous paged caches ``[N, B, Hk, D]`` (their rows
    are the flattened caches') and the buffers' ``cap`` given, so no view is built: a carried
    decode step's per-layer call (:meth:`DecodeKV.attend <servelab.attention.decode_kv.DecodeKV.attend>`).
    Unchecked, as :func:`attend`. Returns float32 ``[rows * kv_per_row, G, D]``."""
    return _decode_attention(q, tiles, values, lens, kv_per_row, cap, width, scale,
                             (key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr()))


def _decode_attention(q: torch.Tensor, tiles: torch.Tensor, values: torch.Tensor, lens: torch.Tensor,
                      kv_per_row: int, cap: int, width: int, scale: float,
                      append: tuple[int | None, int | None, int | None]) -> torch.Tensor:
    """The one ``servelab_decode_attention`` call of :func:`attend` and :func:`attend_rows`
    (``append``: the pointers of the paged K, V and slots, or three ``None``)."""
    rows, num_heads, head_size = q.shape
    heads, group = rows * kv_per_row, num_heads // kv_per_row
    scores = torch.empty(heads, group, width, dtype=torch.float32, device="cpu")  # workspace
    out = torch.empty(heads, group, head_size, dtype=torch.float32, device="cpu")
    _library().servelab_decode_attention(q.data_ptr(), q.stride(0), tiles.data_ptr(), values.data_ptr(),
                                         lens.data_ptr(), scores.data_ptr(), out.data_ptr(), heads, kv_per_row,
                                         group, head_size, cap, width, scale, torch.get_num_threads(), *append)
    return out


def _check(name: str, t: object, dim: int) -> None:
    _require_ndim(name, _require_tensor(name, t), dim, "tensor")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU tensor, got one on {t.device} "
                         f"(contiguous={t.is_contiguous()})")


def _check_lens(lens: torch.Tensor, heads: int, cap: int, width: int) -> int:
    _check("lens", lens, 1)
    if lens.dtype != torch.int64 or lens.numel() == 0 or heads % lens.numel():
        raise ValueError(f"lens must be int64 [rows] with heads ({heads}) a multiple of rows, got "
                         f"{lens.dtype} {tuple(lens.shape)}")
    low, high = int(lens.min()), int(lens.max())
    if low < 1 or high > width or width > cap:
        raise ValueError(f"lens must lie in [1, width] with width <= cap; got lens in [{low}, {high}], "
                         f"width {width}, cap {cap}")
    return heads // lens.numel()


def decode_scores(q: torch.Tensor, tiles: torch.Tensor, lens: torch.Tensor, width: int,
                  scale: float) -> torch.Tensor:
    """``scale * q @ K^T`` per head, ``-inf`` past each row's length.

    Args:
        q: float32 ``[H, G, D]``; tiles: float32 ``[H, cap/16, D, 16]`` (:func:`tile_keys`);
        lens: int64 ``[rows]``, ``H`` a multiple of ``rows`` (head ``h`` belongs to row
        ``h // (H / rows)``), ``1 <= lens <= width <= cap``; width: columns of the result.

    Returns: float32 ``[H, G, width]``.
    """
    _check("q", q, 3)
    _check("tiles", tiles, 4)
    heads, group, head_size = q.shape
    if (q.dtype != torch.float32 or tiles.dtype != torch.float32 or head_size % LANES
            or not 1 <= group <= MAX_GROUP or tuple(tiles.shape[::2]) != (heads, head_size)
            or tiles.shape[3] != LANES):
        raise ValueError(f"q must be float32 [H, G<={MAX_GROUP}, D] with D % {LANES} == 0 and tiles float32 "
                         f"[H, cap/{LANES}, D, {LANES}]; got q {q.dtype} {tuple(q.shape)}, tiles {tiles.dtype} "
                         f"{tuple(tiles.shape)}")
    width = check_int("width", width, min_value=1)
    scale = _positive_finite("scale", scale)
    kv_per_row = _check_lens(lens, heads, tiles.shape[1] * LANES, width)
    if not available():
        raise RuntimeError(f"the C decode-attention kernel is not available (see warnings; {ENV_SWITCH})")
    return _scores(q, kv_per_row * group * head_size, group, tiles, lens, kv_per_row, width, scale)


def decode_pv(p: torch.Tensor, values: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``p @ V`` per head over each row's first ``lens`` positions.

    Args:
        p: float32 ``[H, G, width]`` (columns past a row's length are not read);
        values: float32 ``[H, cap, D]``; lens: as in :func:`decode_scores`.

    Returns: float32 ``[H, G, D]``.
    """
    _check("p", p, 3)
    _check("values", values, 3)
    heads, group, width = p.shape
    if (p.dtype != torch.float32 or values.dtype != torch.float32 or values.shape[0] != heads
            or values.shape[2] % LANES or values.shape[1] % LANES or not 1 <= group <= MAX_GROUP):
        raise ValueError(f"p must be float32 [H, G<={MAX_GROUP}, width] and values float32 [H, cap, D] with "
                         f"cap and D multiples of {LANES}; got p {p.dtype} {tuple(p.shape)}, values "
                         f"{values.dtype} {tuple(values.shape)}")
    kv_per_row = _check_lens(lens, heads, values.shape[1], width)
    if not available():
        raise RuntimeError(f"the C decode-attention kernel is not available (see warnings; {ENV_SWITCH})")
    return _pv(p, values, lens, kv_per_row)
