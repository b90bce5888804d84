"""Qwen2-MoE: the Qwen2 decoder with sparse experts plus a gated shared expert.

Matching Hugging Face's ``Qwen2MoeForCausalLM``: layer ``i`` is sparse when
``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``
(the others keep a dense SwiGLU MLP of width ``intermediate_size``). A sparse
layer routes by softmax then top-k (renormalized when ``norm_topk_prob``) over
experts of width ``moe_intermediate_size``, and adds
``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (width
``shared_expert_intermediate_size``). q/k/v carry a bias when ``qkv_bias``
(the default), o_proj never does.
"""

from __future__ import annotations

from typing import Any

import torch

from servelab.models.config import ModelConfig
from servelab.models.llama import LlamaForCausalLM
from servelab.moe.model import MoEModelMixin, moe_model_config, with_attention_bias


class Qwen2MoeForCausalLM(MoEModelMixin, LlamaForCausalLM):
    """Qwen2-MoE decoder: :class:`LlamaForCausalLM` with sparse MoE blocks (shared expert included)."""

    def __init__(self, config: ModelConfig, attention: Any = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(config, attention, dtype=dtype, device=device)
        self.install_moe(config, dtype=dtype, device=device)


def qwen2_moe_config_from_hf(hf: Any, generation_config: Any = None) -> ModelConfig:
    """:class:`ModelConfig` for a ``qwen2_moe`` config (q/k/v bias from ``qkv_bias``, no o bias)."""
    config = moe_model_config(hf, generation_config, like="qwen2")
    return with_attention_bias(config, qkv=bool(getattr(hf, "qkv_bias", True)), o=False)


__all__ = ["Qwen2MoeForCausalLM", "qwen2_moe_config_from_hf"]
