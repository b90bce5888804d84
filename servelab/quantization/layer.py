"""``QuantizedLinear`` (a :class:`~servelab.models.layer_api.LinearLayer` over packed weights) and
``QuantizedEmbedding`` (a GGUF-blocked lookup table that dequantizes only the rows it reads).

Which path runs a call, in order (chosen per call; every path is held to the method's reference):

1. **CUDA, Triton**: a method with ``triton=True`` (``int8``, ``w4a16``) runs the W8A16 / W4A16
   kernel of :mod:`servelab.kernels.quant_gemm`.
2. **CPU, at most 32 rows** (a decode step): the C kernel (:mod:`servelab.quantization.cpu_kernels`)
   over the packed blocks; the float weight is never built.
3. **CPU, more rows** (a prefill chunk): the method's fast torch ``dequantize`` into a transient
   float weight, then one oneDNN GEMM; the dequantization is paid once per call, shared by all the
   rows (and freed after it), so the model still holds only the packed weight.
4. **Anything else** (no kernel for this device / format, or the C library unavailable): the
   method's reference, with one ``RuntimeWarning`` per layer class and reason; never a silent
   switch to stored float weights.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servelab.quantization import cpu_kernels
from servelab.quantization.methods import QuantMethod, get_quant_method

__all__ = ["QuantizedLinear", "QuantizedEmbedding"]

_warned: set[tuple[str, str]] = set()


def _warn_once(method: str, reason: str) -> None:
    if (method, reason) not in _warned:
        _warned.add((method, reason))
        warnings.warn(f"servelab: quantization method {method!r} has no fast path here ({reason}); running its "
                      "reference (dequantize, then the float matmul)", RuntimeWarning, stacklevel=3)


def _resolve(target: Any) -> Any:
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)
    return target


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored by a registered quantization method.

    Args:
        method: a registered method name or a :class:`~servelab.quantization.QuantMethod`.
        tensors: the method's stored tensors (e.g. GGUF ``{"blocks": uint8 [out, row_bytes]}``), row ``n``
            of each being output row ``n``; kept as buffers (counted in the KV pool sizing's weight bytes).
        in_features, out_features: the layer's widths.
        bias: float ``[out_features]`` or None.
        group_size: the method's group (``w4a16``), for reports.

    ``forward(x [..., in])`` -> ``[..., out]`` in ``x``'s dtype; ``dense_weight()`` -> float32 ``[out, in]``.
    """

    def __init__(self, method: str | QuantMethod, tensors: dict[str, torch.Tensor], in_features: int,
                 out_features: int, bias: torch.Tensor | None = None, *, group_size: int | None = None) -> None:
        super().__init__()
        self.method = get_quant_method(method)
        self.in_features, self.out_features, self.group_size = int(in_features), int(out_features), group_size
        if in_features % max(self.method.block_elems, 1):
            raise ValueError(f"in_features={in_features} is not a multiple of {self.method.name}'s block of "
                             f"{self.method.block_elems} weights")
        self.tensor_names = tuple(tensors)
        for name, tensor in tensors.items():
            if tensor.shape[0] != out_features:
                raise ValueError(f"tensor {name!r} (shape {tuple(tensor.shape)}) must have out_features="
                                 f"{out_features} rows")
            self.register_buffer(name, tensor.contiguous())
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._kernel_call: _KernelCall | None = None  # set by the first C kernel call (forward's fast path)

    # -- the LinearLayer interface -------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name."""
        return {name: getattr(self, name) for name in self.tensor_names}

    def dense_weight(self) -> torch.Tensor:
        """float32 ``[out, in]``: the weight this layer computes with (dequantized; tests and references only)."""
        return self.method.dequantize(self.tensors(), self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call = self._kernel_call
        if (call is not None and x.dim() == 2 and 0 < x.shape[0] <= cpu_kernels.MAX_ROWS
                and x.shape[1] == self.in_features and x.dtype is torch.float32 and x.device.type == "cpu"
                and x.stride(1) == 1 and not (torch.is_grad_enabled() and x.requires_grad)):
            buffers = self._buffers
            if (buffers.get(call.names[0]) is call.tensors[0] and buffers.get(call.names[1]) is call.tensors[1]
                    and buffers.get(call.names[2]) is call.tensors[2] and buffers["bias"] is call.tensors[3]
                    and call.tensors[0].data_ptr() == call.pointers[0]):
                return call(x)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x (shape {tuple(x.shape)}) must be [..., in_features={self.in_features}]")
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        if x.is_cuda and self.method.triton and self._triton_group_ok():
            from servelab.kernels.quant_gemm import quant_gemm
            return quant_gemm(x, self.method.name, self.tensors(), self.in_features, self.bias)
        if x.is_cpu and x.dtype is torch.float32 and not (torch.is_grad_enabled() and x.requires_grad):
            if x.shape[0] <= cpu_kernels.MAX_ROWS:
                out = self._cpu_kernel(x)
                if out is not None:
                    return out
            else:
                return F.linear(x, self._dequantized_for_prefill(), self.bias)
        reason = (f"device {x.device.type}, dtype {x.dtype}" if self.method.cpu_format is None or not x.is_cpu
                  else f"the C kernel library is unavailable: {cpu_kernels.unavailable_reason()}")
        return self.reference(x, reason)

    def _cpu_kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        code = self.method.cpu_format
        if code is None:
            return None
        if code == cpu_kernels.FORMAT_CODES["w4a16"] and not self._kernel_group_ok():
            return None
        if cpu_kernels.library() is None:
            return None
        if x.shape[1] > 1 and x.stride(1) != 1:
            x = x.contiguous()
        stored = self.tensors()
        weight = stored.get("blocks", stored.get("qweight"))
        assert weight is not None
        bias = self.bias if self.bias is None or self.bias.dtype is torch.float32 else self.bias.float()
        if bias is self.bias:  # the fast path's arguments, (re)made where it did not apply
            self._kernel_call = _KernelCall(self, code, weight)
        return cpu_kernels.quant_gemm(code, x, weight, weight.stride(0) * weight.element_size(), self.out_features,
                                      stored.get("scales"), stored.get("zeros"), self.group_size or 0, bias)

    def _dequantized_for_prefill(self) -> torch.Tensor:
        """float32 ``[out, in]`` for a matmul of more rows than the C kernel takes (a prefill): a GGUF
        table is decoded by the C row decoder (the same bits as the method's torch dequantizer, ~8x
        faster: it was a fifth of a 16-request run at 1 thread), others by the method; the float
        weight lives only for this call."""
        code = self.method.cpu_format
        if code is not None and code in cpu_kernels.GGUF_CODES and cpu_kernels.library() is not None:
            blocks = self.tensors()["blocks"]
            return cpu_kernels.gather_rows(code, blocks, self.in_features, torch.arange(self.out_features))
        return self.method.dequantize(self.tensors(), self.in_features)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        self._kernel_call = None  # .to() / .cuda() replace the stored tensors: keep no reference to the old ones
        return super()._apply(fn, recurse)

    def _triton_group_ok(self) -> bool:
        scales = self.tensors().get("scales")
        return self.method.name != "w4a16" or (scales is not None and (self.in_features // scales.shape[1]) % 32 == 0)

    def _kernel_group_ok(self) -> bool:
        group = self.in_features // self.tensors()["scales"].shape[1]
        self.group_size = group
        return group % 16 == 0 and group <= 256

    def reference(self, x: torch.Tensor, reason: str | None = None) -> torch.Tensor:
        """The method's reference on ``x`` (warns once per method and ``reason`` when given)."""
        if reason is not None:
            _warn_once(self.method.name, reason)
        if self.method.reference is None:
            weight = self.method.dequantize(self.tensors(), self.in_features).to(device=x.device, dtype=x.dtype)
            return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))
        function = _resolve(self.method.reference)
        return function(x, self.method.name, self.tensors(), self.in_features, self.bias)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.method.name!r}"
                f"{group}, bias={self.bias is not None}")


class _KernelCall:
    """A layer's C kernel call with its arguments resolved once (the first call through the checked
    path): a decode step calls each layer's kernel once, where the checks, the stored-tensor
    lookups through ``nn.Module.__getattr__`` and the argument building cost more than a small
    layer's kernel. :meth:`QuantizedLinear.forward` uses it while the layer holds the same tensor
    objects (``names`` -> ``tensors``; a ``.to()`` or an assignment replaces them) at the same
    address, for float32 CPU ``x`` ``[1..32, in]`` with contiguous rows outside autograd; the
    same kernel on the same arguments as the checked path, so the same bits."""

    __slots__ = ("names", "tensors", "pointers", "_args", "_out")

    def __init__(self, layer: QuantizedLinear, code: int, weight: torch.Tensor) -> None:
        buffers = layer._buffers
        stored = [n for n in ("blocks", "qweight") if buffers.get(n) is weight][:1]
        names = (stored[0], "scales" if "scales" in buffers else "", "zeros" if "zeros" in buffers else "")
        self.names = names
        self.tensors = (weight, buffers.get(names[1]), buffers.get(names[2]), buffers["bias"])
        self.pointers = tuple(None if t is None else t.data_ptr() for t in self.tensors)
        self._args = (code, weight.stride(0) * weight.element_size(), layer.in_features, layer.out_features,
                      layer.group_size or 0)
        self._out = layer.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float32 CPU ``[rows, in]`` (1 <= rows <= 32, ``x.stride(1) == 1``) -> float32 ``[rows, out]``."""
        code, row_bytes, k, n, group = self._args
        w, scales, zeros, bias = self.pointers
        rows = x.shape[0]
        out = torch.empty(rows, self._out, dtype=torch.float32)
        cpu_kernels.library().servelab_quant_gemm(  # type: ignore[union-attr]
            code, x.data_ptr(), x.stride(0), rows, k, n, w, row_bytes, scales, zeros, group, bias, out.data_ptr(),
            torch.get_num_threads())
        return out


class QuantizedEmbedding(nn.Module):
    """A token embedding stored as GGUF blocks ``[vocab, row_bytes]``; ``forward(ids)`` dequantizes
    only the rows it reads (C gather on a CPU, else the method's torch dequantizer on the rows).

    ``weight`` is an empty ``[0, embedding_dim]`` tensor of the model dtype (what the model's
    ``dtype`` / ``device`` read); the full table is ``dense_weight()``. A tied LM head is a
    :class:`QuantizedLinear` over the same ``blocks`` tensor (no copy): :meth:`tied_head`.
    """

    def __init__(self, method: str | QuantMethod, blocks: torch.Tensor, embedding_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.method = get_quant_method(method)
        self.num_embeddings, self.embedding_dim = int(blocks.shape[0]), int(embedding_dim)
        self.blocks: torch.Tensor
        self.weight: torch.Tensor
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("weight", torch.empty(0, embedding_dim, dtype=dtype, device=blocks.device),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        code = self.method.cpu_format
        if flat.is_cpu and code is not None and cpu_kernels.library() is not None:
            if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
                raise IndexError(f"token id out of range [0, {self.num_embeddings})")
            rows = cpu_kernels.gather_rows(code, self.blocks, self.embedding_dim, flat)
        else:
            rows = self.method.dequantize({"blocks": self.blocks[flat]}, self.embedding_dim)
        return rows.to(self.weight.dtype).reshape(*ids.shape, self.embedding_dim)

    def dense_weight(self) -> torch.Tensor:
        """float32 ``[vocab, dim]``: the whole table (tests and references only)."""
        return self.method.dequantize({"blocks": self.blocks}, self.embedding_dim)

    def tied_head(self) -> QuantizedLinear:
        """The LM head tied to this table: ``hidden [T, dim] -> logits [T, vocab]`` over the same blocks."""
        return QuantizedLinear(self.method, {"blocks": self.blocks}, self.embedding_dim, self.num_embeddings)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, method={self.method.name!r}"
