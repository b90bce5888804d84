"""The ``quantization`` model step (:data:`servelab.pipeline.setup.MODEL_STEPS`): online
quantization of a float model's linear layers, per the resolved :class:`~servelab.quantization.spec.QuantizationPlan`.

A layer the plan gives a method is replaced (``layer_api.replace_module``, fused layers keeping
their ``output_slices``) by a :class:`~servelab.quantization.layer.QuantizedLinear` holding the
quantized tensors; the float weight is dropped. Layers already stored in the planned method (a GGUF
checkpoint loaded natively) are left as they are. Every layer is quantized before any is
replaced, so a refusal leaves the model unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from servelab.models.layer_api import dense_weight, hf_module_names, linear_layers, replace_module
from servelab.quantization.layer import QuantizedLinear
from servelab.quantization.methods import get_quant_method
from servelab.quantization.spec import QuantizationPlan, resolve_plan

__all__ = ["quantize_model", "plan_for_model", "linear_modules"]


def linear_modules(model: nn.Module) -> list[tuple[str, list[str], int]]:
    """``(name, HF names, in_features)`` of every linear layer of ``model`` (what targets match)."""
    return [(name, hf_module_names(name, layer), int(getattr(layer, "in_features")))
            for name, layer in linear_layers(model)]


def plan_for_model(model: nn.Module, setting: Any) -> QuantizationPlan:
    """``setting`` resolved against ``model``: a plan already made for it (the loader's, kept on
    ``model.quantization_plan``) when the setting is that plan or ``"auto"``, else a new one."""
    existing = getattr(model, "quantization_plan", None)
    if isinstance(setting, QuantizationPlan):
        return setting
    if existing is not None and (setting == "auto" or setting is existing):
        return existing
    checkpoint = getattr(model, "checkpoint_formats", None)
    return resolve_plan(setting, linear_modules(model), checkpoint)


@torch.no_grad()
def quantize_model(model: nn.Module, config: Any, **context: Any) -> nn.Module:
    """Apply ``config.quantization`` to ``model`` (in place); returns the model."""
    plan = plan_for_model(model, config.quantization)
    if plan.source != "online":  # float, or a checkpoint's blocks the loader kept: nothing to do here
        object.__setattr__(model, "quantization_plan", plan)
        return model
    layers = dict(linear_layers(model))
    replacements: list[tuple[str, QuantizedLinear]] = []
    for name, method_name in plan.layers:
        layer = layers.get(name)
        if method_name is None or layer is None:
            continue
        if isinstance(layer, QuantizedLinear):
            if layer.method.name != method_name:
                raise ValueError(f"quantization: {name} is stored as {layer.method.name}; the plan asks for "
                                 f"{method_name} (re-quantizing quantized weights is refused)")
            continue
        method = get_quant_method(method_name)
        weight = dense_weight(layer)
        tensors = method.quantize(weight, plan.group_size)
        bias = getattr(layer, "bias", None)
        replacements.append((name, QuantizedLinear(method, tensors, int(getattr(layer, "in_features")),
                                                   int(getattr(layer, "out_features")),
                                                   bias if isinstance(bias, torch.Tensor) else None,
                                                   group_size=plan.group_size)))
    for name, new in replacements:
        replace_module(model, name, new)
    object.__setattr__(model, "quantization_plan", plan)
    return model
