"""Quantized weights: a :class:`QuantSpec` / ``quantization=`` setting resolved per layer
(:mod:`~servelab.quantization.spec`), registered methods (:mod:`~servelab.quantization.methods`:
``int8``, ``w4a16``, the GGUF block types), :class:`QuantizedLinear` running them through C kernels
on a CPU and Triton kernels on CUDA (:mod:`~servelab.quantization.layer`), online quantization as a
pipeline model step (:mod:`~servelab.quantization.apply`) and native GGUF loading
(:mod:`~servelab.quantization.gguf_native`). References: :mod:`servelab.reference.quant_linear`.
"""

from servelab.quantization.methods import QuantMethod, available_quant_methods, get_quant_method, register_quant_method
from servelab.quantization.spec import SHORTHANDS, QuantizationConfigArgs, QuantizationPlan, QuantSpec

__all__ = ["QuantMethod", "QuantSpec", "QuantizationConfigArgs", "QuantizationPlan", "SHORTHANDS",
           "available_quant_methods", "get_quant_method", "register_quant_method"]
