"""SiLU on a CPU in C, bit-identical to torch's; torch's ``F.silu`` is the reference.

Why: the decode glue (:mod:`servelab.models.decode_glue`) runs a layer's SwiGLU product in C,
but left SiLU to torch: on SmolLM2's batch-16 decode step that in-place SiLU on the
``[16, 1536]`` gate took ~24 us a layer on one thread whatever the thread count (24,576
elements are under torch's parallel grain), ~0.7 ms of a ~50 ms two-thread step. The C
SiLU (``csrc/silu.c``) runs inside the glue's down call, its rows split over the glue's
threads.

Same bits: torch's float32 CPU SiLU is ``x / (1 + exp(-x))`` with the SLEEF library's
vectorized ``expf`` over each row's whole vectors and the C library's ``expf`` over the row's
tail; ``csrc/silu.c`` computes the same operations in the same order (its header says how).
Whether that equals torch's result depends on the torch build and the CPU (which vector
kernel torch dispatches to), so :func:`available` checks once per process that torch's vector
width for its CPU capability is this build's (SLEEF's and the C library's ``expf`` agree on all but
~0.3% of inputs, so a tail walked with other vectors could hide among equal values), then compares
the two on probes that reach every range of the exponential (``exp`` underflowing, overflowing, NaN,
subnormal results) and every tail length, and keeps torch's SiLU when a single bit differs
(:func:`unavailable_reason` says why). The tests compare them on 2^32 / 4099 evenly spaced
bit patterns; every one of the 2^32 float32 inputs was compared once on an AVX2 machine
(``tests/models/test_cpu_silu.py`` says how to rerun that).

Where torch splits the op across threads (``rows * n >= TORCH_GRAIN``, more than one thread)
its split may cut a row, and a cut row's tail walks another way: :func:`usable` refuses those
shapes, and the glue then calls torch's SiLU.

Who calls what: :func:`servelab.models.decode_glue.forward` and the int8 pages' prepared layers
(:mod:`servelab.models.quantized_decode_layers`) ask :func:`usable` once per call and pass the
answer to ``servelab_glue_down``; :func:`silu_` is the standalone call (tests, benchmarks).
"""

from __future__ import annotations

import torch

from servelab.models.probed_kernel import ProbedKernel

#: torch's parallel grain for elementwise ops (``at::internal::GRAIN_SIZE``): below it torch never
#: splits an op across threads.
TORCH_GRAIN = 32768

#: torch's SiLU step (two vectors of floats) per CPU capability it reports
#: (``torch.backends.cpu.get_cpu_capability()``); other capabilities are left to the values' probe.
TORCH_STEPS = {"AVX2": 16, "AVX512": 32}



def _probe_values() -> torch.Tensor:
    """float32 ``[65536 + 40]``: every 65,537th bit pattern (all signs, exponents, NaN and
    infinity), then the edges of the exponential's ranges (``exp(-x)`` under- and overflowing)."""
    bits = torch.arange(0, 1 << 32, 65537, dtype=torch.int64)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    edges = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 88.0, -88.0, 88.7228, -88.7228, 100.0, -100.0, 103.9, -103.9,
                          104.0, -104.0, 104.1, -104.1, 1e10, -1e10, float("inf"), float("-inf"), float("nan"),
                          87.33654, -87.33654, 0.5, -0.5, 20.0, -20.0, 1e-20, -1e-20, 3.4e38, -3.4e38, 1.0, -1.0,
                          2.0, -2.0, 10.0, -10.0, 50.0, -50.0, 126.0], dtype=torch.float32)
    return torch.cat([bits.view(torch.float32), edges])


def _probe(lib) -> str | None:
    """``None`` when the kernel equals ``F.silu`` on every probe, else the first mismatch."""
    built_step = int(lib.servelab_silu_step())
    capability = torch.backends.cpu.get_cpu_capability()
    torch_step = TORCH_STEPS.get(capability)
    if torch_step is not None and torch_step != built_step:
        # SLEEF's and the C library's exp differ on ~0.3% of inputs: where the two walk a row's
        # tail with vectors of another width, values alone might not show it
        return (f"torch runs its {capability} kernel (vectors of {torch_step // 2} floats) and this build's "
                f"are {built_step // 2 if built_step else 'scalar'}")
    values = _probe_values()
    step = max(built_step, 1)
    # Every probe value, in rows of 8,195 (a tail of 3 after whole vectors); rows of every tail
    # length below torch's vector step, each after whole vectors; the glue's gate [rows, I], a
    # view of gate_up [rows, 2I].
    shapes = [(8, 8195, 8195)] + [(3, 2 * step + tail, 2 * step + tail) for tail in range(step)] + [(16, 96, 192)]
    for rows, n, stride in shapes:
        need = (rows - 1) * stride + n
        base = values.repeat(need // values.numel() + 1)[:need].roll(rows + n)
        x = base.as_strided((rows, n), (stride, 1))
        # Row by row: each call under torch's grain, so torch walks every row whole at any thread count.
        expected = torch.stack([torch.nn.functional.silu(row) for row in x])
        got = base.clone()
        lib.servelab_silu_rows(got.data_ptr(), rows, n, stride, torch.get_num_threads())
        got = got.as_strided((rows, n), (stride, 1))
        differs = got.view(torch.int32) != expected.view(torch.int32)
        if differs.any():
            where = tuple(differs.nonzero()[0].tolist())
            return (f"its result differs from torch's silu on [{rows}, {n}] at {list(where)} "
                    f"(x = {x[where].item()!r}): this torch or CPU computes exp another way")
    return None


_kernel = ProbedKernel(_probe)
#: ``None`` when the kernel is built and bit-identical to torch's SiLU here, else why not (checked once per
#: process; builds the kernel library if needed). ``available()``: whether :func:`silu_` may run;
#: ``reset()``: forget the check (tests; after ``cpu_kernel_build.reset``).
unavailable_reason, available, reset = _kernel.unavailable_reason, _kernel.available, _kernel.reset


def usable(rows: int, n: int) -> bool:
    """Whether the C SiLU gives torch's bits on ``rows`` rows of ``n`` elements at any thread count:
    the kernel available and ``rows * n`` under :data:`TORCH_GRAIN` (where torch walks every row
    whole)."""
    return rows * n < TORCH_GRAIN and _kernel.usable_library() is not None


def silu_(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x, inplace=True)`` for float32 CPU ``x`` ``[rows, n]`` whose rows are contiguous
    (``x.stride(1) == 1``), in one C call; returns ``x``. Rows apart in memory (a view such as the
    glue's gate) are walked one by one, split over torch's thread count, as torch walks them. Raises ``TypeError`` / ``ValueError``
    naming the argument when it cannot run it (:func:`usable` is the caller's check)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be a float32 CPU [rows, n] tensor with contiguous rows, got {x.dtype} "
                         f"{x.device} {tuple(x.shape)} strides {x.stride()}")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError("x requires grad: the C SiLU is in place and records no graph; use F.silu")
    if not usable(*x.shape):
        raise ValueError(f"x {tuple(x.shape)}: the C SiLU is unavailable ({unavailable_reason()}) or x has "
                         f"rows * n >= {TORCH_GRAIN} elements (torch may split its rows across threads)")
    rows, n = x.shape
    if x.is_contiguous() and rows > 1:
        # torch walks a contiguous tensor as one row (its iterator merges the dims), so its vector
        # steps run across row ends: so does this call (on one thread).
        rows, n = 1, rows * n
    _kernel.lib.servelab_silu_rows(x.data_ptr(), rows, n, x.stride(0), torch.get_num_threads())
    return x
