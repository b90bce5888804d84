"""What the four MoE decoders share: sparse blocks installed into the Llama decoder, the
checkpoint conversion hook, and the config reader's common part.

A MoE decoder is a :class:`~servelab.models.llama.LlamaForCausalLM` (or one of
its subclasses) whose sparse layers' ``mlp`` is a
:class:`~servelab.moe.layer.SparseMoeBlock`; everything else (attention over the
paged cache, RoPE, norms, LM head) is unchanged. A layer whose ``mlp`` is not
the dense SwiGLU never takes the CPU decode glue (its type check), so MoE
layers run the module path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from servelab.models.config import ModelConfig, derived_config
from servelab.moe.checkpoint import convert_checkpoint_tensors
from servelab.moe.config import MoEConfig
from servelab.moe.layer import SparseMoeBlock

__all__ = ["MoEModelMixin", "moe_blocks", "moe_model_config"]

# Fields llama_family_config refuses as "mixture-of-experts layers": neutral stand-ins on its proxy
# (the MoE reader, MoEConfig.from_hf, validates the real values).
_NEUTRAL_FIELDS = ("num_local_experts", "num_experts", "moe_intermediate_size")


def moe_model_config(hf: Any, generation_config: Any, *, like: str) -> ModelConfig:
    """The :class:`ModelConfig` of a MoE checkpoint: its MoE fields validated by
    :meth:`MoEConfig.from_hf`, the rest as the dense family ``like`` reads them.

    Sliding-window attention is refused for the Qwen MoE types (``use_sliding_window``):
    transformers applies it there by ``layer_types``, which tiny and real MoE checkpoints leave off."""
    MoEConfig.from_hf(hf)
    replace: dict[str, Any] = {name: 0 for name in _NEUTRAL_FIELDS if hasattr(hf, name)}
    if hf.model_type in ("qwen2_moe", "qwen3_moe"):
        if getattr(hf, "use_sliding_window", False):
            raise ValueError(f"use_sliding_window=True is not supported for model_type={hf.model_type!r}")
        replace["sliding_window"] = None
        replace["layer_types"] = None
    return derived_config(hf, generation_config, like=like, replace=replace)


def moe_blocks(model: torch.nn.Module) -> list[tuple[int, SparseMoeBlock]]:
    """``(layer index, block)`` of every sparse MoE block of ``model``'s decoder layers."""
    layers: Any = model.model.layers  # type: ignore[union-attr]
    return [(i, layer.mlp) for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)]


class MoEModelMixin:
    """Mixed into a Llama-family decoder class: :meth:`install_moe` after the base ``__init__``."""

    moe_config: MoEConfig

    def install_moe(self, config: ModelConfig, *, dtype: torch.dtype | None, device: Any) -> None:
        """Replace the ``mlp`` of every sparse layer by a :class:`SparseMoeBlock`."""
        self.moe_config = MoEConfig.from_hf(config.hf_config)
        for i, layer in enumerate(self.model.layers):  # type: ignore[attr-defined,arg-type]
            if self.moe_config.sparse_layers[i]:
                layer.mlp = SparseMoeBlock(self.moe_config, config.hidden_size, dtype=dtype, device=device)

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, torch.Tensor, str]]
                           ) -> Iterator[tuple[str, torch.Tensor, str]]:
        """The loader's hook: per-expert checkpoint tensors stacked (:mod:`servelab.moe.checkpoint`)."""
        return convert_checkpoint_tensors(tensors, self.moe_config.num_experts)


def with_attention_bias(config: ModelConfig, *, qkv: bool, o: bool) -> ModelConfig:
    """``config`` with the q/k/v and o biases set (Qwen2-MoE: ``qkv_bias``, never o)."""
    return dataclasses.replace(config, qkv_bias=qkv, o_bias=o)
