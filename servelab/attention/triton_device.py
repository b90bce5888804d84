"""Whether a Triton kernel can launch on a device, and why not: the one rule the attention and
sampling backends report as their refusal (no Triton, no driver without the interpreter, kernels
built for the interpreter but given CUDA tensors, another device type)."""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["triton_device_problem"]


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked entry in sys.modules
        return False


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def triton_device_problem(device: torch.device | str, interpreted: bool | None = None) -> str | None:
    """Why a Triton kernel cannot launch on ``device``, or ``None`` if it can.

    ``interpreted`` says whether the kernels were built under
    ``TRITON_INTERPRET=1`` (Triton decides when a kernel is decorated); when
    ``None`` the current environment variable is used.
    """
    if not _triton_installed():
        return "Triton is not installed (it is published for Linux only); use the 'sdpa' or 'torch' backend"
    device = torch.device(device)
    if interpreted is None:
        interpreted = _interpret_env()
    if device.type == "cpu":
        if not interpreted:
            return (
                "0 active drivers: Triton finds no GPU driver and TRITON_INTERPRET is not "
                "set, so it cannot launch on CPU tensors (export TRITON_INTERPRET=1 before "
                "importing servelab.kernels, or use the 'sdpa' or 'torch' backend)"
            )
        return None
    if device.type == "cuda":
        if interpreted:
            return (
                "the kernels were built for the CPU interpreter (TRITON_INTERPRET=1); "
                "unset it to run them on the GPU"
            )
        if not torch.cuda.is_available():
            return "CUDA is not available to this torch build or machine"
        return None
    return f"Triton kernels run on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), not on {device.type}"
