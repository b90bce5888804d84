"""The one interface of a model's linear layers, which quantization, LoRA and tensor parallelism all build on.

Every projection of a servelab decoder (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``, an untied ``lm_head``) is a module satisfying :class:`LinearLayer`:
it maps ``x [T, in_features]`` to ``[T, out_features]`` in the activation dtype.
Three kinds of piece replace or wrap these modules, always in this order, each
seeing the previous one's result as "a linear layer" and nothing more:

1. **sharding** (tensor parallelism): a layer becomes its rank's column or row
   slice (``servelab.parallel``);
2. **weight quantization**: a layer's weight becomes packed low-bit blocks run
   by a registered method (``servelab.quantization``);
3. **LoRA**: a layer is wrapped so per-request adapter deltas are added to its
   output (``servelab.lora``).

:func:`servelab.pipeline.setup.prepare_model` applies them in that order, once,
from the resolved :class:`~servelab.config.PipelineConfig`.

**Fused projections keep their parts' names.** servelab fuses HF's ``q_proj``,
``k_proj``, ``v_proj`` into ``qkv_proj`` and ``gate_proj``, ``up_proj`` into
``gate_up_proj`` (one GEMM instead of three or two). Checkpoints, PEFT adapters
and quantization targets name the unfused modules, so a fused layer carries
``output_slices``: which rows of its output are which HF module
(:class:`OutputSlice`). :func:`hf_module_names` maps a servelab module name to
the HF names it stands for, so ``targets=["re:.*q_proj"]`` or a LoRA adapter for
``v_proj`` finds its rows. A layer without ``output_slices`` is one HF module of
its own name.

**The reference is the dense weight.** ``dense_weight()`` returns the float
``[out_features, in_features]`` weight the layer computes with (dequantized for a
quantized layer, this rank's shard for a sharded one): every fast path is held
to ``x @ dense_weight().T + bias`` in its tests. Only tests and references call it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["LinearLayer", "OutputSlice", "dense_weight", "hf_module_names", "linear_layers", "output_slices",
           "gate_up_slices", "qkv_slices", "replace_module", "set_output_slices"]


@dataclass(frozen=True)
class OutputSlice:
    """Rows ``[start, start + size)`` of a fused layer's output are HF module ``name`` (e.g. ``"k_proj"``)."""

    name: str
    start: int
    size: int

    def __post_init__(self) -> None:
        if not self.name or self.start < 0 or self.size <= 0:
            raise ValueError(f"OutputSlice({self.name!r}, start={self.start}, size={self.size}) is invalid; "
                             "valid: a non-empty name, start >= 0, size >= 1")


@runtime_checkable
class LinearLayer(Protocol):
    """What every linear-like module of a servelab model provides.

    Attributes:
        in_features, out_features: widths of ``x`` and of the output.
        bias: float ``[out_features]`` or None.
    """

    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in_features]`` (the model dtype) -> ``[T, out_features]`` (the same dtype)."""
        ...

    def dense_weight(self) -> torch.Tensor:
        """The float ``[out_features, in_features]`` weight this layer computes with (its reference)."""
        ...


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """``layer.dense_weight()`` where the layer defines it, else its ``weight`` (a plain ``nn.Linear``)."""
    method = getattr(layer, "dense_weight", None)
    if callable(method):
        return method()
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(layer).__name__} has neither dense_weight() nor a weight tensor")
    return weight


def output_slices(layer: nn.Module, name: str) -> tuple[OutputSlice, ...]:
    """The HF modules whose rows make up ``layer``'s output; ``name`` is the layer's own
    (last) module name, used when it declares none (an unfused layer is one module)."""
    declared = getattr(layer, "output_slices", None)
    if declared:
        return tuple(declared)
    return (OutputSlice(name, 0, int(getattr(layer, "out_features"))),)


def set_output_slices(layer: nn.Module, slices: tuple[OutputSlice, ...]) -> None:
    """Declare a fused layer's parts (checked to tile its output exactly, in order)."""
    start = 0
    for part in slices:
        if part.start != start:
            raise ValueError(f"output slices {slices!r} must tile the output in order from row 0")
        start += part.size
    if start != int(getattr(layer, "out_features")):
        raise ValueError(f"output slices {slices!r} cover {start} rows; the layer has {layer.out_features}")
    object.__setattr__(layer, "output_slices", tuple(slices))  # a plain attribute, not a submodule


def hf_module_names(qualified_name: str, layer: nn.Module) -> list[str]:
    """``"model.layers.0.self_attn.qkv_proj"`` -> ``["model.layers.0.self_attn.q_proj", "...k_proj",
    "...v_proj"]``: the HF names a servelab module stands for (itself when unfused)."""
    prefix, _, last = qualified_name.rpartition(".")
    parts = [s.name for s in output_slices(layer, last)]
    return [f"{prefix}.{p}" if prefix else p for p in parts]


def linear_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name, module)`` for every linear layer of ``model``, in module order: any
    ``nn.Linear`` (servelab's packed :class:`~servelab.models.linear.Linear` included) and any
    module that declares ``in_features``, ``out_features`` and ``dense_weight`` (a replaced layer).
    A wrapper's inner layer is not listed again."""
    wrapped: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in wrapped:
            continue
        if isinstance(module, nn.Linear) or (
                hasattr(module, "in_features") and hasattr(module, "out_features")
                and callable(getattr(module, "dense_weight", None))):
            for inner in module.modules():
                if inner is not module:
                    wrapped.add(id(inner))
            yield name, module


def replace_module(model: nn.Module, qualified_name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` where ``qualified_name`` is (``"model.layers.3.mlp.down_proj"``); returns the old module.
    The new module keeps the old one's ``output_slices`` unless it declares its own."""
    parent_name, _, attr = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr, None)
    if not isinstance(old, nn.Module):
        raise ValueError(f"{qualified_name!r} is not a module of {type(model).__name__}")
    if not getattr(new, "output_slices", None) and getattr(old, "output_slices", None):
        object.__setattr__(new, "output_slices", old.output_slices)
    setattr(parent, attr, new)
    return old


def qkv_slices(q_size: int, kv_size: int) -> tuple[OutputSlice, ...]:
    """A fused ``qkv_proj``'s parts: ``[q (q_size) | k (kv_size) | v (kv_size)]`` rows."""
    return (OutputSlice("q_proj", 0, q_size), OutputSlice("k_proj", q_size, kv_size),
            OutputSlice("v_proj", q_size + kv_size, kv_size))


def gate_up_slices(intermediate_size: int) -> tuple[OutputSlice, ...]:
    """A fused ``gate_up_proj``'s parts: ``[gate | up]``, ``intermediate_size`` rows each."""
    return (OutputSlice("gate_proj", 0, intermediate_size), OutputSlice("up_proj", intermediate_size,
                                                                         intermediate_size))
