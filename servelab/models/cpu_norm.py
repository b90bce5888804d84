"""RMSNorm in one C call on a CPU, bit-identical to ``torch.rms_norm``; torch is the reference.

Why: on a CPU ``torch.rms_norm`` is a composite of about ten small ops. On a
decode step the tensors are tiny (``[rows, hidden]`` with a few dozen rows),
so a norm costs its op dispatches and allocations, not its arithmetic: on a
2-core AMD EPYC (Zen 4) a norm of ``[1, 256]`` took ~11 us in a warm loop and
~48 us inside a step (the knock-out of all 9 norms of a 4-layer model saved
0.44 ms of a 3.5 ms step); the C kernel (``csrc/rms_norm.c``, built with the
decode-attention kernel by :mod:`servelab.attention.cpu_kernel_build`) takes
~3 us.

Same bits, checked: the kernel sums the squares in the order torch's CPU sum
kernel does (the file's header says which), so the result equals
``torch.rms_norm`` bit for bit, and with it transformers' op-by-op RMSNorm
(``tests/models/test_layers.py``). That order belongs to a torch build and a
CPU architecture, so :func:`available` compares the two once per process on
shapes that reach every branch of the cascade and stays on torch when a
single bit differs (:func:`unavailable_reason` says why).

Who calls what: :class:`servelab.models.layers.RMSNorm` calls :func:`usable`
then :func:`rms_norm` on each CPU float32 forward; the kernel is built the
first time that happens in a process unless the decode path built it first
(``SERVELAB_CPU_KERNELS=0`` turns both off).
"""

from __future__ import annotations

import torch

from servelab.models.probed_kernel import ProbedKernel

#: the smallest hidden size the kernel takes (one vector of torch's sum kernel).
MIN_HIDDEN = 8



def _probe(lib) -> str | None:
    """``None`` when the kernel equals ``torch.rms_norm`` on every probe, else the first mismatch."""
    gen = torch.Generator().manual_seed(0)
    # 8: one vector; 17: a scalar tail; 576: groups of 4 vectors plus a remainder;
    # 8221, 16573: cascade levels carried (>= 256 groups) and every kind of tail; 12 x 4096: threads.
    for rows, n in ((1, 8), (3, 17), (5, 576), (2, 8221), (1, 16573), (12, 4096)):
        # float32 on the CPU whatever torch's defaults (a float64 default once failed this probe and
        # kept torch's norm for the whole process).
        x = torch.randn(rows, n, generator=gen, dtype=torch.float32, device="cpu") * 7.0
        weight = torch.randn(n, generator=gen, dtype=torch.float32, device="cpu")
        expected = torch.rms_norm(x, (n,), weight, 1e-6)
        got = torch.empty_like(x)
        lib.servelab_rms_norm(x.data_ptr(), weight.data_ptr(), got.data_ptr(), rows, n, 1e-6, torch.get_num_threads())
        if not torch.equal(got, expected):
            return (f"its result differs from torch.rms_norm on [{rows}, {n}] (max |diff| "
                    f"{(got - expected).abs().max().item():.3g}): this torch or CPU sums in another order")
    return None


_kernel = ProbedKernel(_probe)
#: ``None`` when the kernel is built and bit-identical to torch.rms_norm here, else why not (checked once per
#: process; builds the kernel library if needed). ``available()``: whether :func:`rms_norm` may run;
#: ``reset()``: forget the check (tests; after ``cpu_kernel_build.reset``).
unavailable_reason, available, reset = _kernel.unavailable_reason, _kernel.available, _kernel.reset


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` handles ``x`` ``[..., n]`` and ``weight`` ``[n]``: float32 CPU
    tensors, both contiguous, ``n >= 8``, autograd not recording, and the kernel available."""
    return (x.dtype is torch.float32 and weight.dtype is torch.float32 and x.is_cpu and weight.is_cpu and x.shape[-1] >= MIN_HIDDEN and weight.shape == x.shape[-1:]
            and x.is_contiguous() and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and _kernel.usable_library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.rms_norm(x, weight.shape, weight, eps)`` for float32 ``x`` ``[..., n]``, weight ``[n]``
    (same shape and dtype out), in one C call. Raises ``TypeError`` / ``ValueError`` naming the
    argument when :func:`usable` would refuse it."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"x and weight must be tensors, got {type(x).__name__} and {type(weight).__name__}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps={eps!r} must be a non-negative number")
    if not usable(x, weight):
        raise ValueError(
            f"x (shape {tuple(x.shape)}, {x.dtype}, {x.device}, contiguous={x.is_contiguous()}) and weight "
            f"(shape {tuple(weight.shape)}, {weight.dtype}) must be contiguous float32 CPU tensors with weight "
            f"[n] matching x [..., n], n >= {MIN_HIDDEN}, outside autograd, and the kernel available "
            f"({unavailable_reason() or 'it is'}); use torch.rms_norm otherwise")
    return _rms_norm(x, weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` unchecked (the module's hot path, after :func:`usable`)."""
    out = torch.empty_like(x)
    n = x.shape[-1]
    _kernel.lib.servelab_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps,
                           torch.get_num_threads())
    return out
