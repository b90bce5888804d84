"""Greedy decoding's argmax in one C call on a CPU (``csrc/argmax.c``); ``torch.argmax`` is the reference.

Why: torch's CPU ``argmax`` over a large vocabulary runs far below the read
rate: SmolLM2's 16 x 49,152 logits took ~1.2 ms on one core of a 2-core AMD
EPYC (Zen 4) VM, where ``amax`` over the same tensor takes ~55 us and the
C pass ~60 us; that was ~1.5% of a batch-16 decode step. The pass's vectors are one
register wide on every target (16 lanes with AVX-512, 8 with AVX, 4 with SSE2): with
16-lane vectors on a Zen 3 (AVX2) VM gcc kept them on the stack and the pass took 2.2-3.9 ms
(3-5% of that step), against ~0.10 ms at one register wide. The C pass keeps
each of 16 lanes' largest value and its first position, then combines the
lanes: the first position of the row's maximum, as ``torch.argmax`` returns.
Indices, not sums, so there is no rounding to match: the result equals the
reference exactly (``tests/samplers/test_cpu_argmax.py``).

Who calls what: :meth:`servelab.samplers.Sampler.greedy_tokens` (the
all-plain-greedy shortcut) calls :func:`finite_argmax`, which takes the C
pass when :func:`usable` and ``torch.argmax`` otherwise; ``SERVELAB_CPU_KERNELS=0``
(read at the first call in a process) keeps torch.
"""

from __future__ import annotations

import torch

from servelab.attention import cpu_decode

_library = cpu_decode.LibraryOnce()  # the hot path calls _library.lib


def usable(logits: torch.Tensor) -> bool:
    """Whether the C pass reads ``logits``: a float32 CPU ``[rows, n]`` with each row contiguous
    (rows any stride, ``1 <= n < 2**31``), autograd not recording it, and the kernel library built."""
    return (logits.dtype is torch.float32 and logits.is_cpu and logits.dim() == 2 and 1 <= logits.shape[1] < 2**31
            and (logits.stride(1) == 1 or logits.shape[1] == 1)
            and not (torch.is_grad_enabled() and logits.requires_grad) and _library() is not None)


def finite_argmax(logits: torch.Tensor) -> list[int] | None:
    """Each row's first maximal index of ``logits`` float ``[rows, n]``, or ``None`` when some row's
    maximum is not finite (a NaN anywhere in it, ``+inf``, or a row of ``-inf``).

    Equal to ``logits.argmax(dim=-1).tolist()`` whenever it returns a list (the reference path,
    taken when :func:`usable` refuses, is exactly that with the same finiteness rule). Raises
    ``TypeError`` / ``ValueError`` naming ``logits`` when it is not a floating ``[rows, n >= 1]`` tensor."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a tensor, got {type(logits).__name__}")
    if logits.dim() != 2 or logits.shape[1] < 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point [rows, n] tensor with n >= 1, got "
                         f"{logits.dtype} of shape {tuple(logits.shape)}")
    if not usable(logits):
        picked = logits.argmax(dim=-1)
        # argmax propagates NaN like amax, so the logit it picks is each row's max: finite exactly
        # when the row's maximum is (no second full-row reduction needed).
        if not bool(torch.isfinite(logits.gather(1, picked[:, None])).all()):
            return None
        return picked.tolist()
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device="cpu")
    _library.lib.servelab_argmax_rows(logits.data_ptr(), logits.stride(0), rows, n, out.data_ptr(),
                                      torch.get_num_threads())
    tokens: list[int] = out.tolist()
    return None if -1 in tokens else tokens
