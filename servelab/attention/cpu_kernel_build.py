"""Build, cache, verify and load the C CPU kernels, one library: decode attention
(``csrc/decode_attention.c``, used by :mod:`servelab.attention.cpu_decode`), RMSNorm
(``csrc/rms_norm.c``, :mod:`servelab.models.cpu_norm`), RoPE (``csrc/rope.c``,
:mod:`servelab.models.cpu_rope`), the few-row GEMM (``csrc/panel_gemm.c``,
:mod:`servelab.models.cpu_gemm`) and a decoder layer's glue on a decode step
(``csrc/decode_glue.c``, :mod:`servelab.models.decode_glue`), greedy decoding's
argmax (``csrc/argmax.c``, :mod:`servelab.samplers.cpu_argmax`), SiLU with torch's bits
(``csrc/silu.c``, :mod:`servelab.models.cpu_silu`), and decode attention straight
over quantized KV pages (``csrc/decode_attention_quant.c``, reading the pages through
``csrc/quant_pages.h``; :mod:`servelab.attention.cpu_decode_quant`) with its quantizing int8 cache
write (``csrc/kv_write_int8.c``, :mod:`servelab.attention.ops`), and a pure decode step's later
layers over int8 pages from prepared structs (``csrc/decode_layers.c``,
:mod:`servelab.models.quantized_decode_layers`).

Who calls what, when: :func:`load` is called by :mod:`servelab.attention.cpu_decode`
(``available()``), which the ``"sdpa"`` backend calls when a pipeline is
constructed (so the first decode step is not a compile), and by
``servelab build-kernels``. It runs once per process (under a lock) and
returns the loaded library or raises :class:`KernelBuildError`.

Flags. The sources are compiled with ``$CC`` (default ``cc``) under the first
of :data:`FLAG_SETS` that compiles and verifies: ``-O3 -march=native
-fopenmp``, then without OpenMP, then without ``-march=native``, then
``-O3`` alone.

Cache key. One file per ``(sources, compiler version, flags, resolved
target)`` under :func:`servelab._internal.paths.kernel_cache_dir`
(``<cache root>/kernels/``, or ``$SERVELAB_KERNEL_CACHE``),
named by a hash of the four. The *resolved target* is what the compiler will
really generate code for with those flags: the target options the driver
hands its compiler proper (``cc <flags> -### -E -x c /dev/null``: gcc's
``-march=znver3 -mavx512f -mno-amx-tile ...``, clang's ``-target-cpu`` and
``-target-feature`` list), so two machines that share a home directory share
a binary only when ``-march=native`` means the same instructions on both
(a CPU *model name*, or a VM that masks features, is not enough). The hash
is also compiled into the library (``servelab_build_key()``), and a library
whose embedded key is not the expected one is never loaded.

Verification. Before the process loads a library it runs every entry point
once in a child process (:data:`_VERIFY_SCRIPT`, ``ctypes`` only, no torch):
an instruction the CPU lacks kills the child with SIGILL, which the parent
survives; the library is then rebuilt once (it may be stale or corrupt) and,
failing again, the next flag set is tried. Verified once per process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from servelab._internal.paths import kernel_cache_dir

SOURCES: tuple[Path, ...] = tuple(Path(__file__).with_name("csrc") / name
                                  for name in ("decode_attention.c", "rms_norm.c", "rope.c", "panel_gemm.c",
                                               "decode_glue.c", "argmax.c", "decode_attention_quant.c",
                                               "kv_write_int8.c", "silu.c", "decode_layers.c"))
#: Headers the sources include: not compiled on their own, but hashed with them.
HEADERS: tuple[Path, ...] = tuple(Path(__file__).with_name("csrc") / name
                                 for name in ("quant_pages.h", "decode_quant_avx2.h", "calls.h"))
ABI_VERSION = 16
FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-march=native"),
    ("-O3", "-fopenmp"),
    ("-O3",),
)
_TIMEOUT_S = 300


class KernelBuildError(RuntimeError):
    """No flag set gave a library that compiled and verified (or no compiler); the message says why."""


@dataclass(frozen=True)
class BuiltKernel:
    """A verified, loaded kernel library: its file, cache key, flags and OpenMP support."""

    library: ctypes.CDLL
    path: Path
    key: str
    flags: tuple[str, ...]
    openmp: bool


_built: BuiltKernel | None = None
_error: KernelBuildError | None = None
_lock = threading.Lock()


def compiler() -> str:
    """``$CC``, else ``cc``."""
    return os.environ.get("CC", "cc")


def resolved_target(cc: str, flags: tuple[str, ...]) -> str:
    """The target options ``cc`` resolves ``flags`` to (gcc: ``-march=...``, ``-m<feature>`` /
    ``-mno-<feature>``, cache ``--param``\\ s; clang: ``-target-cpu``, ``-target-feature``),
    one per line, in the driver's order. Raises :class:`KernelBuildError` when the driver
    prints none (a compiler that hides them cannot be keyed safely with ``-march=native``)."""
    done = subprocess.run([cc, *flags, "-###", "-E", "-x", "c", os.devnull], capture_output=True, text=True,
                          timeout=60)
    picked: list[str] = []
    for line in (done.stderr + done.stdout).splitlines():
        try:
            tokens = shlex.split(line)
        except ValueError:
            continue
        if not tokens or not any(t in ("-E", "-cc1") for t in tokens[1:]):
            continue  # not the compiler-proper command line
        for previous, token in zip([""] + tokens, tokens):
            if previous in ("-target-cpu", "-target-feature", "-triple", "--param", "-tune-cpu"):
                picked.append(f"{previous} {token}")
            elif token.startswith("-m") and not token.startswith("-mrelocation"):
                picked.append(token)
    if not picked and "-march=native" in flags:
        raise KernelBuildError(f"{cc} does not show what -march=native resolves to (cc -### printed no target "
                               "options), so a cached binary could not be matched to this CPU")
    return "\n".join(picked)


def cache_key(source: bytes, version: str, flags: tuple[str, ...], target: str) -> str:
    """16 hex digits hashing everything that decides the binary."""
    parts = [source, version.encode(), " ".join(flags).encode(), target.encode(), str(ABI_VERSION).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def library_path(key: str) -> Path:
    """Where the library of cache key ``key`` lives."""
    return kernel_cache_dir() / f"cpu_kernels-{key}.so"


def source_bytes() -> bytes:
    """The sources' and headers' contents, concatenated (what the cache key hashes)."""
    return b"\0".join(path.read_bytes() for path in SOURCES + HEADERS)


def compile_library(cc: str, flags: tuple[str, ...], key: str, target: Path) -> str | None:
    """Compile :data:`SOURCES` into ``target`` (atomically: a concurrent build never sees a
    partial file); ``None`` on success, else the compiler's last error line."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        done = subprocess.run([cc, *flags, f'-DSERVELAB_BUILD_KEY="{key}"', "-shared", "-fPIC", "-o",
                               str(partial), *map(str, SOURCES)], capture_output=True, text=True, timeout=_TIMEOUT_S)
        if done.returncode != 0:
            return (done.stderr.strip().splitlines()[-1:] or ["unknown error"])[0]
        os.replace(partial, target)
    return None


# Runs every entry point on small inputs (GQA groups 1-8, both value loops, the norm, the rotation,
# the GEMM's row blocks and partial panel, 2 threads) and checks the embedded key. ctypes only:
# quick to start, and a SIGILL kills only this child.
_VERIFY_SCRIPT = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
assert lib.servelab_abi_version() == int(sys.argv[3]), "ABI version"
lib.servelab_build_key.restype = ctypes.c_char_p
assert lib.servelab_build_key().decode() == sys.argv[2], "embedded build key"
P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
lib.servelab_decode_scores.argtypes = [P, I, P, P, P, I, I, I, I, I, I, F, I]
lib.servelab_decode_pv.argtypes = [P, P, P, P, I, I, I, I, I, I, I]
lib.servelab_decode_attention.argtypes = [P, I, P, P, P, P, P, I, I, I, I, I, I, F, I, P, P, P]
rows, kv, cap = 2, 2, 64
for d in (16, 64):
    for g in range(1, 9):
        heads = rows * kv
        q = (ctypes.c_float * (heads * g * d))(*[0.5] * (heads * g * d))
        k = (ctypes.c_float * (heads * cap * d))(*[0.25] * (heads * cap * d))
        lens = (ctypes.c_int64 * rows)(cap, 17)
        s = (ctypes.c_float * (heads * g * cap))()
        out = (ctypes.c_float * (heads * g * d))()
        lib.servelab_decode_scores(q, kv * g * d, k, lens, s, heads, kv, g, d, cap, cap, 1.0, 2)
        assert abs(s[0] - 0.125 * d) < 1e-3, s[0]
        lib.servelab_decode_pv(s, k, lens, out, heads, kv, g, d, cap, cap, 2)
        lib.servelab_decode_attention(q, kv * g * d, k, k, lens, s, out, heads, kv, g, d, cap, cap, 1.0, 2,
                                      None, None, None)
        assert abs(out[0] - 0.25) < 1e-5, out[0]  # uniform weights over equal values
        slots = (ctypes.c_int64 * rows)(0, 1)
        tiles, values = (ctypes.c_float * (heads * cap * d))(), (ctypes.c_float * (heads * cap * d))()
        lib.servelab_decode_attention(q, kv * g * d, tiles, values, lens, s, out, heads, kv, g, d, cap, cap, 1.0,
                                      2, k, k, slots)
        assert tiles[(cap - 1) // 16 * d * 16 + (cap - 1) % 16] == 0.25 and values[(cap - 1) * d] == 0.25
lib.servelab_write_kv.argtypes = [P, I, P, I, P, P, P, I, I]
src = (ctypes.c_float * 12)(*range(12))
dst_k, dst_v = (ctypes.c_float * 16)(), (ctypes.c_float * 16)()
lib.servelab_write_kv(src, 6, src, 4, dst_k, dst_v, (ctypes.c_int64 * 2)(3, 0), 2, 4)  # rows of 4 into slots 3, 0
assert list(dst_k[12:16]) == [0, 1, 2, 3] and list(dst_k[0:4]) == [6, 7, 8, 9] and dst_v[0] == 4, list(dst_k)
lib.servelab_rms_norm.argtypes = [P, P, P, I, I, F, I]
for n in (8, 17, 576):
    x = (ctypes.c_float * (4 * n))(*[2.0] * (4 * n))
    w = (ctypes.c_float * n)(*[3.0] * n)
    y = (ctypes.c_float * (4 * n))()
    lib.servelab_rms_norm(x, w, y, 4, n, 0.0, 2)  # rms 2.0: x / rms * w == 3.0 everywhere
    assert y[0] == 3.0 and y[4 * n - 1] == 3.0, (y[0], y[4 * n - 1])
lib.servelab_rope.argtypes = [P, I, P, P, P, I, I, I, I]
x = (ctypes.c_float * (3 * 2 * 16))(*[float(i % 16) for i in range(3 * 2 * 16)])
c, s = (ctypes.c_float * (3 * 16))(*[1.0] * 48), (ctypes.c_float * (3 * 16))(*[0.5] * 48)
y = (ctypes.c_float * (3 * 2 * 16))()
lib.servelab_rope(x, 2 * 16, y, c, s, 3, 2, 16, 2)
assert y[0] == 0.0 * 1.0 + 8.0 * 0.5 and y[3 * 2 * 16 - 1] == 15.0 + 7.0 * 0.5, (y[0], y[95])
lib.servelab_panel_gemm.argtypes = [P, I, P, P, P, I, I, I, I]
lib.servelab_panel_gemm_width.restype = I
width = lib.servelab_panel_gemm_width()
assert width in (16, 64), width
for rows, k, n in ((1, 3, 5), (7, 40, 130), (3, 64, 300)):  # row blocks 6 + 1, a partial panel, 2 threads
    panels = -(-n // width)
    x = (ctypes.c_float * (rows * k))(*[1.0] * (rows * k))
    w = (ctypes.c_float * (panels * k * width))(*[0.5] * (panels * k * width))
    b = (ctypes.c_float * n)(*[2.0] * n)
    y = (ctypes.c_float * (rows * n))()
    lib.servelab_panel_gemm(x, k, w, b, y, rows, k, n, 2)
    assert y[0] == 0.5 * k + 2.0 and y[rows * n - 1] == 0.5 * k + 2.0, (y[0], y[rows * n - 1])
assert lib.servelab_panel_gemm_preferred() in (0, 1)
lib.servelab_glue_qkv.argtypes = [P, P, F, P, P, P, P, P, P, P, I, I, I, I, I, I]
lib.servelab_glue_out.argtypes = [P, I, P, P, P, P, P, F, P, P, P, P, I, I, I, I, I]
lib.servelab_glue_down.argtypes = [P, I, I, P, P, P, P, I, I, I]
rows, hidden, d = 2, 16, 8  # weights of 0.5 over ones: every GEMM output is 0.5 * K + bias
ones = lambda n: (ctypes.c_float * n)(*[1.0] * n)
half = lambda n, k: (ctypes.c_float * (-(-n // width) * k * width))(*[0.5] * (-(-n // width) * k * width))
x, normed, h, y = ones(rows * hidden), ones(rows * hidden), ones(rows * hidden), ones(rows * hidden)
qkv, qk, gu = ones(rows * 3 * d), ones(rows * 2 * d), ones(rows * 2 * 4)
c, s = ones(rows * d), (ctypes.c_float * (rows * d))()
lib.servelab_glue_qkv(x, ones(hidden), 0.0, normed, half(3 * d, hidden), None, qkv, qk, c, s, rows, hidden, 3 * d,
                      2, d, 2)
assert normed[0] == 1.0 and qkv[0] == 8.0 and qk[2 * d * rows - 1] == 8.0, (normed[0], qkv[0], qk[0])
lib.servelab_glue_out(qkv, 3 * d, half(hidden, 2 * d), None, x, h, ones(hidden), 0.0, normed, half(8, hidden), None,
                      gu, rows, 2 * d, hidden, 8, 2)
assert h[0] == 0.5 * 8.0 * 2 * d + 1.0 and gu[7] == 8.0, (h[0], gu[7])  # attn = qkv: 8.0 everywhere
lib.servelab_glue_down(gu, 4, 0, half(hidden, 4), None, h, y, rows, hidden, 2)
assert y[rows * hidden - 1] == 0.5 * 4 * 64.0 + h[0], y[rows * hidden - 1]
lib.servelab_silu_rows.argtypes = [P, I, I, I, I]
x = (ctypes.c_float * 40)(*[0.0] * 39 + [-200.0])  # silu(0) = 0; silu(-200) = -0 (exp overflows)
lib.servelab_silu_rows(x, 2, 20, 20, 2)
assert x[0] == 0.0 and x[39] == 0.0, (x[0], x[39])
lib.servelab_argmax_rows.argtypes = [P, I, I, I, P, I]
x = (ctypes.c_float * 60)(*[float(i % 7) for i in range(60)])  # rows of 20: maxima 6.0 first at 6 and 0
x[45] = float("nan")  # the third row holds a NaN: not finite
out = (ctypes.c_int64 * 3)()
lib.servelab_argmax_rows(x, 20, 3, 20, out, 2)
assert list(out) == [6, 0, -1], list(out)
lib.servelab_paged_decode_quant.argtypes = [P, I, P, P, P, P, P, P, P, I, P, I, I, I, I, I, I, I, F, P, I, P, I]
lib.servelab_paged_decode_quant.restype = ctypes.c_int
d, bs = 16, 4  # one row, one KV head, group 2, 6 positions in blocks 1 and 2 of int8 pages of ones
pages = (ctypes.c_int8 * (3 * bs * d))(*[1] * (3 * bs * d))
scales = (ctypes.c_float * (3 * bs))(*[0.5] * (3 * bs))
strides = (ctypes.c_int64 * 6)(bs * d, d, d, bs * d, d, d)
scale_strides = (ctypes.c_int64 * 6)(bs, 1, 1, bs, 1, 1)
q = (ctypes.c_float * (2 * d))(*[1.0] * (2 * d))
s, out = (ctypes.c_float * (2 * 2 * 8))(), (ctypes.c_float * (2 * d))()  # scores: 2 threads' slots
for fmt in (1, 2, 3):  # 0x01 as float8 is a tiny subnormal: only int8's value is checked
    rc = lib.servelab_paged_decode_quant(q, 2 * d, pages, pages, strides, scales, scales, scale_strides,
                                         (ctypes.c_int32 * 2)(1, 2), 2, (ctypes.c_int32 * 1)(6), 1, 1, 2, d, bs, 0,
                                         fmt, 1.0, s, 8, out, 2)
    assert rc == 0 and (fmt != 1 or abs(out[0] - 0.5) < 1e-6), (rc, out[0])
lib.servelab_write_kv_int8.argtypes = [P, I, P, I, P, P, P, P, P, P, I, P, I, I, I, I]
row = (ctypes.c_float * d)(*[float(j - 8) for j in range(d)])  # amax 8: scale 8 / 127
lib.servelab_write_kv_int8(row, d, row, d, pages, pages, strides, scales, scales, scale_strides, 0,
                           (ctypes.c_int64 * 1)(5), 1, 1, d, bs)  # slot 5: block 1, offset 1
assert pages[bs * d + d] == -127 and pages[bs * d + d + 15] == 111 and abs(scales[5] - 8 / 127) < 1e-7
lib.servelab_write_decode_int8.argtypes = [P, I, P, I, P, I, P, I, P, P, P, P, P, P, P, I, P, I, I, I, I, I, I,
                                           F, P, I, P, I]
lib.servelab_write_decode_int8.restype = ctypes.c_int
rc = lib.servelab_write_decode_int8(row, d, row, d, (ctypes.c_int64 * 1)(6), 0, q, 2 * d, pages, pages, strides, scales,
                                    scales, scale_strides, (ctypes.c_int32 * 2)(1, 2), 2, (ctypes.c_int32 * 1)(7), 1, 1,
                                    2, d, bs, 0, 1.0, s, 8, out, 2)  # slot 6 written, then 7 positions attended
assert rc == 0 and pages[bs * d + 2 * d] == -127 and abs(scales[6] - 8 / 127) < 1e-7, (rc, pages[bs * d + 2 * d])
print("ok")
"""


def verify(path: Path, key: str) -> str | None:
    """Run :data:`_VERIFY_SCRIPT` on ``path`` in a child process; ``None`` if it passed, else why not."""
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _VERIFY_SCRIPT, str(path), key, str(ABI_VERSION)],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "verification timed out"
    if done.returncode == 0 and done.stdout.strip().endswith("ok"):
        return None
    if done.returncode < 0:
        return f"verification child killed by signal {-done.returncode} (an instruction this CPU lacks?)"
    lines = done.stderr.strip().splitlines()
    return f"verification failed: {lines[-1] if lines else f'exit status {done.returncode}'}"


def _bind(path: Path, key: str, flags: tuple[str, ...]) -> BuiltKernel:
    lib = ctypes.CDLL(str(path))
    lib.servelab_build_key.restype = ctypes.c_char_p
    if lib.servelab_abi_version() != ABI_VERSION or lib.servelab_build_key().decode() != key:
        raise KernelBuildError(f"{path} is not the library it claims to be (ABI or build key mismatch)")
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.servelab_decode_scores.argtypes = [p, i, p, p, p, i, i, i, i, i, i, ctypes.c_float, i]
    lib.servelab_decode_scores.restype = None
    lib.servelab_decode_pv.argtypes = [p, p, p, p, i, i, i, i, i, i, i]
    lib.servelab_decode_pv.restype = None
    lib.servelab_decode_attention.argtypes = [p, i, p, p, p, p, p, i, i, i, i, i, i, ctypes.c_float, i, p, p,
                                              p]
    lib.servelab_decode_attention.restype = None
    lib.servelab_write_kv.argtypes = [p, i, p, i, p, p, p, i, i]
    lib.servelab_write_kv.restype = None
    lib.servelab_rms_norm.argtypes = [p, p, p, i, i, ctypes.c_float, i]
    lib.servelab_rms_norm.restype = None
    lib.servelab_rope.argtypes = [p, i, p, p, p, i, i, i, i]
    lib.servelab_rope.restype = None
    lib.servelab_panel_gemm.argtypes = [p, i, p, p, p, i, i, i, i]
    lib.servelab_panel_gemm.restype = None
    lib.servelab_panel_gemm_preferred.argtypes = []
    lib.servelab_panel_gemm_preferred.restype = ctypes.c_int
    lib.servelab_panel_gemm_width.argtypes = []
    lib.servelab_panel_gemm_width.restype = ctypes.c_int64
    f = ctypes.c_float
    lib.servelab_glue_qkv.argtypes = [p, p, f, p, p, p, p, p, p, p, i, i, i, i, i, i]
    lib.servelab_glue_out.argtypes = [p, i, p, p, p, p, p, f, p, p, p, p, i, i, i, i, i]
    lib.servelab_glue_down.argtypes = [p, i, i, p, p, p, p, i, i, i]
    lib.servelab_silu_rows.argtypes = [p, i, i, i, i]
    lib.servelab_silu_rows.restype = None
    lib.servelab_silu_step.argtypes = []
    lib.servelab_silu_step.restype = i
    lib.servelab_argmax_rows.argtypes = [p, i, i, i, p, i]
    lib.servelab_decode_layers_sizes.argtypes, lib.servelab_decode_layers_sizes.restype = [i], i
    lib.servelab_decode_layer_attend.argtypes, lib.servelab_decode_layer_attend.restype = [p, p, p], ctypes.c_int
    lib.servelab_decode_layer_down.argtypes, lib.servelab_decode_layer_down.restype = [p, p, p], None
    lib.servelab_decode_layers.argtypes, lib.servelab_decode_layers.restype = [p, p, i], ctypes.c_int
    for name in ("servelab_glue_qkv", "servelab_glue_out", "servelab_glue_down", "servelab_argmax_rows"):
        getattr(lib, name).restype = None
    lib.servelab_paged_decode_quant.argtypes = [p, i, p, p, p, p, p, p, p, i, p, i, i, i, i, i, i, i, f, p, i,
                                                p, i]
    lib.servelab_paged_decode_quant.restype = ctypes.c_int
    lib.servelab_write_kv_int8.argtypes = [p, i, p, i, p, p, p, p, p, p, i, p, i, i, i, i]
    lib.servelab_write_kv_int8.restype = None
    lib.servelab_write_decode_int8.argtypes = [p, i, p, i, p, i, p, i, p, p, p, p, p, p, p, i, p, i, i, i, i, i, i,
                                               f, p, i, p, i]
    lib.servelab_write_decode_int8.restype = ctypes.c_int
    return BuiltKernel(lib, path, key, flags, bool(lib.servelab_openmp()))


def _build_one(cc: str, version: str, source: bytes, flags: tuple[str, ...]) -> BuiltKernel | str:
    """A verified library for one flag set, or why there is none."""
    try:
        key = cache_key(source, version, flags, resolved_target(cc, flags))
    except (OSError, subprocess.SubprocessError) as error:
        return f"{' '.join(flags)}: {error}"
    path = library_path(key)
    cached = path.is_file()
    for attempt in range(2):  # a cached file that fails verification is rebuilt once
        if not cached or attempt == 1:
            failure = compile_library(cc, flags, key, path)
            if failure is not None:
                return f"{' '.join(flags)}: {failure}"
        failure = verify(path, key)
        if failure is None:
            return _bind(path, key, flags)
        if not cached:
            break
    return f"{' '.join(flags)}: {failure}"


def build() -> BuiltKernel:
    """Compile (or reuse from the cache), verify and load the kernel: the first flag set of
    :data:`FLAG_SETS` that works. Raises :class:`KernelBuildError` with every reason."""
    cc = compiler()
    if shutil.which(cc) is None:
        raise KernelBuildError(f"no C compiler ({cc!r} not found; set CC)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelBuildError(f"{cc} --version failed: {error}") from None
    source = source_bytes()
    reasons = []
    for flags in FLAG_SETS:
        outcome = _build_one(cc, version, source, flags)
        if isinstance(outcome, BuiltKernel):
            return outcome
        reasons.append(outcome)
    raise KernelBuildError(f"{cc} gave no working kernel ({'; '.join(reasons)})")


def load() -> BuiltKernel:
    """:func:`build` once per process (later calls return the same library, or raise the same error)."""
    global _built, _error
    if _built is not None:
        return _built
    with _lock:  # one build per process, even when two threads start decoding at once
        if _built is None and _error is None:
            try:
                _built = build()
            except KernelBuildError as error:
                _error = error
            except (OSError, subprocess.SubprocessError) as error:
                _error = KernelBuildError(str(error))
    if _built is None:
        raise _error  # type: ignore[misc]
    return _built


def reset() -> None:
    """Forget this process's build outcome (tests; a new ``$CC`` or cache root). A library
    already loaded stays mapped; the next :func:`load` builds or verifies again."""
    global _built, _error
    with _lock:
        _built, _error = None, None


# ---- a piece's own C library (quantized GEMM, LoRA) -----------------------------------------


def build_library(name: str, source: Path, abi: int, key_macro: str, verify_script: str
                  ) -> tuple[ctypes.CDLL | None, str]:
    """``source`` built into its own cached ``<name>-<key>.so`` with the first of :data:`FLAG_SETS`
    that compiles and passes ``verify_script`` (Python run in a child process with the library's
    path and key as ``argv[1:3]``; it prints ``ok``), for a piece that keeps its C beside it
    (:mod:`servelab.quantization.cpu_kernels`, :mod:`servelab.lora.cpu_kernels`) so changing it
    rebuilds only that library. The key hashes the source, the compiler's version, the flags, the
    resolved target and ``abi``; the source receives it as ``-D<key_macro>="<key>"``.

    Returns the loaded library (its functions' ``argtypes`` are the caller's to set), or ``None``
    and why: ``SERVELAB_CPU_KERNELS=0``, no compiler, or each flag set's failure."""
    if os.environ.get("SERVELAB_CPU_KERNELS", "1") == "0":
        return None, "SERVELAB_CPU_KERNELS=0"
    cc = compiler()
    if shutil.which(cc) is None:
        return None, f"no C compiler ({cc!r} not found; set CC)"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"{cc} --version failed: {error}"
    reasons = []
    for flags in FLAG_SETS:
        outcome = _build_library_with(name, source, abi, key_macro, verify_script, cc, version, flags)
        if not isinstance(outcome, str):
            return outcome, ""
        reasons.append(outcome)
    return None, "; ".join(reasons)


def _build_library_with(name: str, source: Path, abi: int, key_macro: str, verify_script: str, cc: str,
                        version: str, flags: tuple[str, ...]) -> ctypes.CDLL | str:
    """:func:`build_library` with one flag set: the loaded library, or why not (one line)."""
    label = " ".join(flags)
    try:
        target = resolved_target(cc, flags)
    except (OSError, subprocess.SubprocessError, KernelBuildError) as error:
        return f"{label}: {error}"
    key = hashlib.sha256(b"\0".join([source.read_bytes(), version.encode(), label.encode(), target.encode(),
                                     str(abi).encode()])).hexdigest()[:16]
    path = kernel_cache_dir() / f"{name}-{key}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            partial = Path(tmp) / path.name
            done = subprocess.run([cc, *flags, f'-D{key_macro}="{key}"', "-shared", "-fPIC", "-o", str(partial),
                                   str(source)], capture_output=True, text=True, timeout=_TIMEOUT_S)
            if done.returncode != 0:
                return f"{label}: {(done.stderr.strip().splitlines()[-1:] or ['error'])[0]}"
            os.replace(partial, path)
    checked = subprocess.run([sys.executable, "-I", "-c", verify_script, str(path), key], capture_output=True,
                             text=True, timeout=120)
    if checked.returncode != 0 or not checked.stdout.strip().endswith("ok"):
        path.unlink(missing_ok=True)  # rebuilt by the next process
        return f"{label}: verification failed ({(checked.stderr.strip().splitlines()[-1:] or [''])[0]})"
    return ctypes.CDLL(str(path))
