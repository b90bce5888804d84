"""Mixtral: the Mistral decoder with a sparse mixture of experts in every layer.

Matching Hugging Face's ``MixtralForCausalLM``: each layer's MLP is a router
(``mlp.gate``, ``[num_local_experts, hidden]``) choosing ``num_experts_per_tok``
experts by softmax (float32) then top-k, their weights always renormalized to
sum to 1, and SwiGLU experts of width ``intermediate_size``
(:class:`~servelab.moe.layer.SparseMoeBlock`). Attention is Mistral's (a
sliding window on every layer when the config sets one). Checkpoints with
``block_sparse_moe.experts.N.w1/w2/w3`` tensors load through
:mod:`servelab.moe.checkpoint`.
"""

from __future__ import annotations

from typing import Any

import torch

from servelab.models.config import ModelConfig
from servelab.models.llama import LlamaForCausalLM
from servelab.moe.model import MoEModelMixin, moe_model_config


class MixtralForCausalLM(MoEModelMixin, LlamaForCausalLM):
    """Mixtral decoder: :class:`LlamaForCausalLM` with a sparse MoE block as every layer's MLP."""

    def __init__(self, config: ModelConfig, attention: Any = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(config, attention, dtype=dtype, device=device)
        self.install_moe(config, dtype=dtype, device=device)


def mixtral_config_from_hf(hf: Any, generation_config: Any = None) -> ModelConfig:
    """:class:`ModelConfig` for a ``mixtral`` config: the MoE fields checked, the rest as Mistral's."""
    return moe_model_config(hf, generation_config, like="mistral")


__all__ = ["MixtralForCausalLM", "mixtral_config_from_hf"]
