"""Quantization methods: the :class:`QuantMethod` interface and its registry.

A method says how a float weight ``[out, in]`` becomes stored tensors (``quantize``; absent for
formats only read from files, such as the K-quants), how those tensors give back the float weight
(``dequantize``, the fast torch form: what ``dense_weight()`` and prefill batches use), which C
kernel format runs it on a CPU (``cpu_format``, a code of
:data:`servelab.quantization.cpu_kernels.FORMAT_CODES`, or ``None``), whether the Triton
W4A16/W8A16 kernel runs it on CUDA (``triton``), and its ``reference``: a lazy
``"module:function"`` computing ``reference(x, tensors, in_features, bias)`` the plain way (the
fallback where no fast path fits the device, with one warning).

Register your own with ``register_quant_method(name, QuantMethod(...))``; a :class:`QuantSpec`
names it as ``method``. Built in: ``"int8"`` (W8A16 per output channel), ``"w4a16"``
(group-wise 4-bit RTN with zeros; ``group_size`` 32 or 128), and the GGUF block types ``"Q8_0"``,
``"Q4_0"``, ``"Q4_1"``, ``"Q5_0"``, ``"Q4_K"``, ``"Q6_K"``, ``"F16"``, ``"F32"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from servelab._internal.registry import Registry
from servelab.quantization import formats

__all__ = ["QuantMethod", "register_quant_method", "get_quant_method", "available_quant_methods"]

Tensors = dict[str, torch.Tensor]


def _no_quantizer(name: str) -> Callable[..., Tensors]:
    def refuse(weight: torch.Tensor, group_size: int | None = None) -> Tensors:
        raise ValueError(f"quantization method {name!r} has no online quantizer (its weights come from a "
                         "checkpoint file); online methods: int8, w4a16, Q8_0, Q4_0, Q4_1")
    return refuse


@dataclass(frozen=True)
class QuantMethod:
    """One way of storing and running a linear layer's weight (see the module docs).

    Attributes:
        name: the registry name.
        quantize: ``(weight float [out, in], group_size | None) -> tensors``.
        dequantize: ``(tensors, in_features) -> float32 [out, in]``.
        reference: ``"module:function"`` (or the function) computing
            ``(x [T, in], method name, tensors, in_features, bias) -> [T, out]`` by dequantizing
            first; None: ``dequantize`` then ``F.linear`` (the default for a user's method).
        bits_per_weight: storage cost, for reports.
        cpu_format: the C kernel's format code, or None (no CPU kernel).
        triton: whether the Triton kernel runs it on CUDA.
        block_elems: input width of one block (the width must be a multiple); 1 for none.
    """

    name: str
    quantize: Callable[..., Tensors]
    dequantize: Callable[[Tensors, int], torch.Tensor]
    reference: Any = None
    bits_per_weight: float = 32.0
    cpu_format: int | None = None
    triton: bool = False
    block_elems: int = 1
    options: dict[str, Any] = field(default_factory=dict)


def _check_method(obj: Any) -> None:
    missing = [a for a in ("name", "quantize", "dequantize", "reference") if not hasattr(obj, a)]
    if missing:
        raise TypeError(f"a quantization method needs {', '.join(missing)} (see servelab.quantization.QuantMethod); "
                        f"got {type(obj).__name__}")


_REGISTRY: Registry[QuantMethod] = Registry("quantization method", check=_check_method)


def register_quant_method(name: str, method: QuantMethod | str, *, override: bool = False) -> None:
    """Register ``method`` (or a lazy ``"module:attr"``) under ``name``."""
    _REGISTRY.register(name, method, override=override)


def get_quant_method(name_or_method: str | QuantMethod) -> QuantMethod:
    """The method registered as ``name`` (ValueError listing the known ones), or a method object checked."""
    return _REGISTRY.get(name_or_method)


def available_quant_methods() -> list[str]:
    """Registered method names, sorted."""
    return _REGISTRY.available()


def _gguf_method(kind: str, code: int | None) -> QuantMethod:
    fmt = formats.GGUF_FORMATS[kind]
    online = kind in ("Q8_0", "Q4_0", "Q4_1", "F16", "F32")

    def quantize(weight: torch.Tensor, group_size: int | None = None) -> Tensors:
        return {"blocks": formats.quantize_gguf(kind, weight)}

    def dequantize(tensors: Tensors, in_features: int) -> torch.Tensor:
        return formats.dequantize_gguf(kind, tensors["blocks"], in_features)

    return QuantMethod(kind, quantize if online else _no_quantizer(kind), dequantize, reference=_REFERENCE,
                       bits_per_weight=fmt.bits_per_weight, cpu_format=code, block_elems=fmt.block_elems)


def _int8_quantize(weight: torch.Tensor, group_size: int | None = None) -> Tensors:
    if group_size is not None:
        raise ValueError(f"group_size={group_size!r} does not apply to 'int8' (per output channel); valid: None")
    return formats.quantize_int8(weight)


def _w4a16_quantize(weight: torch.Tensor, group_size: int | None = None) -> Tensors:
    return formats.quantize_w4a16(weight, 128 if group_size is None else group_size)


_REFERENCE = "servelab.reference.quant_linear:quant_linear"
register_quant_method("int8", QuantMethod(
    "int8", _int8_quantize, lambda t, k: formats.dequantize_int8(t["qweight"], t["scales"]), reference=_REFERENCE,
    bits_per_weight=8.0, cpu_format=0, triton=True))
register_quant_method("w4a16", QuantMethod(
    "w4a16", _w4a16_quantize, lambda t, k: formats.dequantize_w4a16(t["qweight"], t["scales"], t["zeros"]),
    reference=_REFERENCE, bits_per_weight=4.25, cpu_format=1, triton=True))
for _kind, _code in (("Q8_0", 2), ("Q4_0", 3), ("Q4_1", 4), ("Q5_0", 5), ("Q4_K", 6), ("Q6_K", 7), ("F16", None),
                     ("F32", None)):
    register_quant_method(_kind, _gguf_method(_kind, _code))
