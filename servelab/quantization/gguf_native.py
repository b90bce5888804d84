"""Load a GGUF file's weights keeping their blocks (``quantization="auto"``).

Called by :func:`servelab.models.loader.load_model` on a model built empty for the file's config:

- every linear layer the plan keeps quantized becomes a :class:`QuantizedLinear` over the file's
  blocks (a fused ``qkv_proj`` / ``gate_up_proj`` whose parts share a type is one layer over the
  parts' rows; parts of different types, as in Q4_K_M's ``attn_v`` in Q6_K, become a
  :class:`FusedQuantizedLinear` of one layer per part); llama.cpp's q/k row permutation is undone
  by reordering block rows, never by decoding;
- the token embedding, when stored in a block type, becomes a :class:`QuantizedEmbedding`
  (a lookup dequantizes only the rows it reads) and, when the head is tied to it, the head is a
  :class:`QuantizedLinear` over the same blocks (one copy in memory);
- everything else (norms, biases, float or ignored layers) is dequantized into the model's parameters.

Every tensor of the file must be used and every parameter written: a mismatch is a ValueError.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from servelab.models.gguf import NativeGGUF
from servelab.models.layer_api import hf_module_names, linear_layers, replace_module
from servelab.quantization.formats import GGUF_FORMATS
from servelab.quantization.layer import QuantizedEmbedding, QuantizedLinear
from servelab.quantization.methods import available_quant_methods, get_quant_method
from servelab.quantization.spec import QuantizationPlan, matches, resolve_plan

__all__ = ["FusedQuantizedLinear", "load_native_weights", "keeps_blocks"]

_FLOAT_KINDS = ("F32", "F16")


def keeps_blocks(setting: Any) -> bool:
    """Whether ``setting`` asks for a GGUF file's blocks to be kept (not None / ``"none"``)."""
    return not (setting is None or (isinstance(setting, str) and setting.lower() == "none"))


class FusedQuantizedLinear(nn.Module):
    """A fused layer whose parts are stored in different formats: one :class:`QuantizedLinear` per
    part, outputs concatenated (``[T, sum of parts' out_features]``)."""

    def __init__(self, parts: list[QuantizedLinear]) -> None:
        super().__init__()
        self.parts: list[QuantizedLinear] = nn.ModuleList(parts)  # type: ignore[assignment]
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def dense_weight(self) -> torch.Tensor:
        return torch.cat([part.dense_weight() for part in self.parts], dim=0)

    @property
    def method_label(self) -> str:
        return "+".join(part.method.name for part in self.parts)


def _checkpoint_formats(gguf: NativeGGUF, model: nn.Module) -> dict[str, str]:
    """servelab linear module name -> its stored format (``"Q4_K+Q6_K"`` for mixed fused parts)."""
    formats: dict[str, str] = {}
    for name, layer in linear_layers(model):
        kinds = []
        for part in hf_module_names(name, layer):
            stored = gguf.tensors.get(gguf.gguf_name(f"{part}.weight") or "")
            if stored is None:
                raise ValueError(f"GGUF file {gguf.info.file.name!r} has no tensor for {part}.weight")
            kinds.append(stored.tensor_type.name)
        unique = list(dict.fromkeys(kinds))
        formats[name] = unique[0] if len(unique) == 1 else "+".join(kinds)
    return formats


def _check_kind(kind: str, where: str) -> None:
    if kind not in GGUF_FORMATS or kind not in available_quant_methods():
        kernels = [k for k in GGUF_FORMATS if get_quant_method(k).cpu_format is not None]
        raise ValueError(f"GGUF tensor {where} is stored as {kind}, which servelab has no kernel for; valid types: "
                         f"{', '.join(kernels)} (and F16/F32); pass quantization=None to dequantize the file")


def _quantized_part(gguf: NativeGGUF, hf_weight: str) -> tuple[str, torch.Tensor, int, int]:
    stored = gguf.get(hf_weight)
    _check_kind(stored.kind, f"{stored.name!r} ({hf_weight})")
    blocks = stored.data.reshape(stored.rows, -1)
    order = gguf.rows_order(hf_weight, stored.rows)
    return stored.kind, (blocks if order is None else blocks[order]), stored.rows, stored.cols


def _build_layer(gguf: NativeGGUF, name: str, layer: nn.Module) -> nn.Module:
    parts = [_quantized_part(gguf, f"{part}.weight") for part in hf_module_names(name, layer)]
    bias = None
    if getattr(layer, "bias", None) is not None:
        bias = torch.cat([gguf.float_tensor(f"{part}.bias") for part in hf_module_names(name, layer)])
    kinds = {kind for kind, _, _, _ in parts}
    in_features = int(getattr(layer, "in_features"))
    if len(kinds) == 1:
        kind = parts[0][0]
        blocks = torch.cat([b for _, b, _, _ in parts]) if len(parts) > 1 else parts[0][1]
        return QuantizedLinear(kind, {"blocks": blocks}, in_features, int(getattr(layer, "out_features")), bias)
    layers, start = [], 0
    for kind, blocks, rows, _ in parts:
        part_bias = None if bias is None else bias[start:start + rows]
        layers.append(QuantizedLinear(kind, {"blocks": blocks}, in_features, rows, part_bias))
        start += rows
    return FusedQuantizedLinear(layers)


@torch.no_grad()
def _copy_float(gguf: NativeGGUF, model: nn.Module, skip: set[str]) -> None:
    """Every remaining parameter from the file (dequantized), fused layers part by part."""
    layers = dict(linear_layers(model))
    for pname, param in model.named_parameters():
        module = pname.rpartition(".")[0]
        if module in skip or any(pname.startswith(s + ".") for s in skip):
            continue
        leaf = pname.rpartition(".")[2]
        if module in layers:
            start = 0
            for part in hf_module_names(module, layers[module]):
                value = gguf.float_tensor(f"{part}.{leaf}")
                param[start:start + value.shape[0]].copy_(value.reshape(param[start:start + value.shape[0]].shape))
                start += value.shape[0]
            continue
        value = gguf.float_tensor(pname)
        if value.numel() != param.numel():
            raise ValueError(f"GGUF tensor for {pname!r} has {value.numel()} values; the model expects "
                             f"{tuple(param.shape)}")
        param.copy_(value.reshape(param.shape))


@torch.no_grad()
def load_native_weights(model: nn.Module, gguf: NativeGGUF, setting: Any) -> QuantizationPlan:
    """Load ``gguf`` into the empty ``model`` keeping blocks per the resolved ``setting``; returns
    the plan (also kept as ``model.quantization_plan``, the file's formats as ``model.checkpoint_formats``)."""
    formats = _checkpoint_formats(gguf, model)
    modules = [(name, hf_module_names(name, layer), int(getattr(layer, "in_features")))
               for name, layer in linear_layers(model)]
    plan = resolve_plan(setting, modules, formats, other_modules=("model.embed_tokens",))
    embed, skip = _embedding(gguf, model, plan)
    for name, layer in list(linear_layers(model)):
        if plan.method_of(name) is not None:
            replace_module(model, name, _build_layer(gguf, name, layer))
            skip.add(name)
    _copy_float(gguf, model, skip)
    lm_head = getattr(model, "lm_head", None)
    if embed is not None and lm_head is None:  # tied: the head reads the embedding's blocks
        model.lm_head = embed.tied_head()
    unused = gguf.unused()
    if unused:
        raise ValueError(f"GGUF file {gguf.info.file.name!r} holds tensor(s) the model did not load: "
                         f"{', '.join(unused[:6])}")
    groups = dict(plan.groups)
    if embed is not None:
        groups["model.embed_tokens"] = embed.method.name
        if lm_head is None:
            groups["lm_head"] = f"{embed.method.name} (tied to model.embed_tokens)"
    plan = QuantizationPlan(plan.source, plan.args, plan.layers, plan.group_size, groups)
    object.__setattr__(model, "quantization_plan", plan)
    object.__setattr__(model, "checkpoint_formats", formats)
    return plan


def _embedding(gguf: NativeGGUF, model: nn.Module, plan: QuantizationPlan) -> tuple[QuantizedEmbedding | None,
                                                                                     set[str]]:
    """The embedding kept in blocks (when stored so and not ignored), put in place."""
    name = "model.embed_tokens"
    stored_name = gguf.gguf_name(f"{name}.weight")
    stored = gguf.tensors.get(stored_name or "")
    ignore = plan.args.ignore if plan.args is not None and plan.args.ignore is not None else ()
    if (plan.source != "checkpoint" or stored is None or stored.tensor_type.name in _FLOAT_KINDS
            or any(matches(p, [name]) for p in ignore)):
        return None, set()
    native = gguf.get(f"{name}.weight")
    _check_kind(native.kind, f"{native.name!r} ({name}.weight)")
    table = model.get_submodule(name)
    dtype = table.weight.dtype
    assert isinstance(dtype, torch.dtype)
    embed = QuantizedEmbedding(native.kind, native.data.reshape(native.rows, -1), native.cols, dtype=dtype)
    replace_module(model, name, embed)
    return embed, {name}
