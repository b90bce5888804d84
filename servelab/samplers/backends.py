"""Choosing between the Triton kernels and their PyTorch references.

``"torch"`` (the reference) runs anywhere. ``"triton"`` needs CUDA tensors,
or CPU tensors with ``TRITON_INTERPRET=1`` set before the kernels were
imported. ``"auto"`` takes Triton for CUDA tensors when it can launch there
and the reference otherwise (CPU tensors, or no usable Triton). Asking for
``"triton"`` where it cannot run raises a ``ValueError`` carrying the reason
from :func:`servelab.backends.triton_device_problem`; nothing falls back
silently. Kernels are imported lazily so that ``servelab.samplers`` imports
without Triton.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from servelab.backends import triton_device_problem

BACKENDS = ("auto", "torch", "triton")


def check_backend_name(backend: object) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r} is invalid; valid: one of {BACKENDS}")
    return backend


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton sampling kernels cannot take tensors on ``device`` (None if they can)."""
    return triton_device_problem(device)


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """``"torch"`` or ``"triton"`` for tensors on ``device``; raise if ``"triton"`` cannot run there."""
    check_backend_name(backend)
    if backend == "auto":
        use_triton = torch.device(device).type == "cuda" and triton_device_problem(device) is None
        return "triton" if use_triton else "torch"
    if backend == "triton":
        reason = triton_device_problem(device)
        if reason is not None:
            raise ValueError(f"backend='triton' cannot run on {torch.device(device)}: {reason}")
    return backend


def op_module(name: str, backend: str, device: torch.device | str) -> ModuleType:
    """The module holding op ``name`` (e.g. ``"sampling"``) for the resolved backend."""
    package = "servelab.kernels" if resolve_backend(backend, device) == "triton" else "servelab.reference"
    return importlib.import_module(f"{package}.{name}")
