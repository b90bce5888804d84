"""RoPE in one C call on a CPU, the same bits as :func:`servelab.models.llama.rotate` (the reference).

Why: the torch form is a roll, two multiplies and an add, each allocating its
``[T, heads, D]`` result; on a decode step those are a few kilobytes, so the
four dispatches are the cost (~15-25 us per layer inside a step on a 2-core
AMD EPYC, Zen 4). ``csrc/rope.c`` (built with the other CPU kernels by
:mod:`servelab.attention.cpu_kernel_build`) does the same two rounded products
and one sum per element in one call. Elementwise with no reduction, so no
order to match: the bits are equal by construction, and
``tests/models/test_cpu_rope.py`` holds them equal on random shapes.

Who calls what: :func:`servelab.models.llama.rotate` asks :func:`usable`, then
calls :func:`rope`; ``SERVELAB_CPU_KERNELS=0`` (read at the first call in a
process) keeps torch.
"""

from __future__ import annotations

import torch

from servelab.attention import cpu_decode

_library = cpu_decode.LibraryOnce()  # the hot path calls _library.lib


def tables_usable(cos: torch.Tensor, signed_sin: torch.Tensor, tokens: int, head_size: int) -> bool:
    """Whether :func:`rope` reads these tables: float32 CPU ``[tokens, 1, head_size]`` views of
    contiguous ``[tokens, head_size]``, autograd not recording them (also asked by
    :mod:`servelab.models.decode_glue`, before the rotated ``x`` exists)."""
    table = (tokens, 1, head_size)
    return all(t.dtype is torch.float32 and t.is_cpu and t.shape == table and t.stride(0) == head_size
               and t.stride(2) == 1 and not (torch.is_grad_enabled() and t.requires_grad)
               for t in (cos, signed_sin))


def usable(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
    """Whether :func:`rope` handles these: float32 CPU tensors, ``x`` ``[T, heads, D]`` with heads
    and dimensions contiguous, ``cos``/``signed_sin`` ``[T, 1, D]`` views of contiguous ``[T, D]``,
    ``D`` even, autograd not recording, and the kernel library built."""
    if x.dtype is not torch.float32 or x.dim() != 3 or not x.is_cpu:
        return False
    tokens, heads, head_size = x.shape
    return (head_size % 2 == 0 and x.stride(2) == 1 and x.stride(1) == head_size
            and tables_usable(cos, signed_sin, tokens, head_size)
            and not (torch.is_grad_enabled() and x.requires_grad) and _library() is not None)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`servelab.models.llama.rotate` of ``x`` ``[T, heads, D]``: a new contiguous
    ``[T, heads, D]`` float32, in one C call. Raises ``TypeError`` / ``ValueError`` naming the
    arguments when :func:`usable` would refuse them."""
    for name, value in (("x", x), ("cos", cos), ("signed_sin", signed_sin)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if not usable(x, cos, signed_sin):
        raise ValueError(
            f"x (shape {tuple(x.shape)}, strides {x.stride()}, {x.dtype}) with cos / signed_sin (shapes "
            f"{tuple(cos.shape)} / {tuple(signed_sin.shape)}) must be float32 CPU tensors: x [T, heads, D] "
            "with heads and dimensions contiguous, D even, the tables [T, 1, D] views of contiguous [T, D], "
            "outside autograd, and the kernel library built; use llama.rotate otherwise")
    return _rope(x, cos, signed_sin)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`rope` unchecked (``rotate``'s hot path, after :func:`usable`)."""
    tokens, heads, head_size = x.shape
    out = torch.empty(tokens, heads, head_size, dtype=torch.float32, device="cpu")
    _library.lib.servelab_rope(x.data_ptr(), x.stride(0), out.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(),
                               tokens, heads, head_size, torch.get_num_threads())
    return out
