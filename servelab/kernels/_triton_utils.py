"""Small helpers shared by the attention kernels' host code."""

from __future__ import annotations

import functools

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from servelab.attention.backends import triton_device_problem


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was created under ``TRITON_INTERPRET=1``.

    Triton decides at decoration time, so this, not the current environment,
    says whether a launch on CPU tensors can work.
    """
    return isinstance(kernel, InterpretedFunction)


def require_launchable(name: str, tensor: torch.Tensor, kernel: object) -> None:
    """Raise ``ValueError`` (with the registry's reason) if ``kernel`` cannot run on ``tensor``'s device."""
    problem = triton_device_problem(tensor.device, interpreted=is_interpreted(kernel))
    if problem is not None:
        raise ValueError(f"{name} is on {tensor.device}: {problem}")


def dot_in_fp32(dtype: torch.dtype, interpreted: bool) -> bool:
    """Upcast ``tl.dot`` operands to float32?

    Under the interpreter a bfloat16 ``tl.dot`` returns garbage while bf16
    loads, stores and casts are exact, so bf16 dots are done in fp32 there.
    On a GPU the native bf16 tensor-core dot stays.
    """
    return interpreted and dtype == torch.bfloat16


def head_size_padded(head_size: int) -> int:
    """Power of two >= ``head_size`` and >= 16 (``tl.dot`` needs K >= 16)."""
    return max(16, triton.next_power_of_2(head_size))


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Nominal SM count used to reason about grids under the interpreter, where
# there is no device to ask. Small, so that heuristics behave as on a small GPU.
INTERPRETER_SM_COUNT = 4


def sm_count(device: torch.device) -> int:
    """Number of streaming multiprocessors of ``device`` (nominal on CPU)."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_SM_COUNT
