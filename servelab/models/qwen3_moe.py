"""Qwen3-MoE: the Qwen3 decoder (per-head q/k RMSNorm) with sparse experts.

Matching Hugging Face's ``Qwen3MoeForCausalLM``: attention is Qwen3's
(:class:`~servelab.models.qwen3.Qwen3Attention`); sparse layers as Qwen2-MoE's
(``decoder_sparse_step``, ``mlp_only_layers``), routing by softmax then top-k
(renormalized when ``norm_topk_prob``), experts of width
``moe_intermediate_size``, no shared expert.
"""

from __future__ import annotations

from typing import Any

import torch

from servelab.models.config import ModelConfig
from servelab.models.qwen3 import Qwen3ForCausalLM
from servelab.moe.model import MoEModelMixin, moe_model_config


class Qwen3MoeForCausalLM(MoEModelMixin, Qwen3ForCausalLM):
    """Qwen3-MoE decoder: :class:`Qwen3ForCausalLM` with sparse MoE blocks."""

    def __init__(self, config: ModelConfig, attention: Any = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(config, attention, dtype=dtype, device=device)
        self.install_moe(config, dtype=dtype, device=device)


def qwen3_moe_config_from_hf(hf: Any, generation_config: Any = None) -> ModelConfig:
    """:class:`ModelConfig` for a ``qwen3_moe`` config (q/k/v and o biased together by ``attention_bias``)."""
    return moe_model_config(hf, generation_config, like="qwen2")


__all__ = ["Qwen3MoeForCausalLM", "qwen3_moe_config_from_hf"]
