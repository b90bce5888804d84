"""Reference of :func:`servelab.kernels.quant_gemm.quant_gemm`, with the same signature.

Dequantize the whole weight (:func:`servelab.reference.quant_linear.dequantize`), then one float
matmul. The Triton kernel never builds the float weight; its tests hold it to this function in
float64 (``tests/quantization/test_triton_quant_gemm.py``).
"""

from __future__ import annotations

import torch

from servelab.reference.quant_linear import quant_linear

__all__ = ["quant_gemm"]


def quant_gemm(x: torch.Tensor, method: str, tensors: dict[str, torch.Tensor], in_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, in_features]`` -> ``[M, out]`` in ``x``'s dtype, for ``method`` ``"int8"`` or ``"w4a16"``
    (the kernel's two layouts; see its docstring). ValueError for another method or a wrong ``x``."""
    if method not in ("int8", "w4a16"):
        raise ValueError(f"method={method!r} has no Triton kernel to mirror; valid: 'int8', 'w4a16'")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x (shape {tuple(x.shape)}) must be [M, {in_features}]")
    return quant_linear(x, method, tensors, in_features, bias)
