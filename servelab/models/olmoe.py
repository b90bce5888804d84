"""OLMoE: a Llama-style decoder with full-width q/k RMSNorm, optional q/k/v clipping, and sparse experts.

Matching Hugging Face's ``OlmoeForCausalLM``: the query projection is
normalized by one RMSNorm over its whole width (``q_norm``, ``[heads *
head_dim]``) and the key projection likewise (``k_norm``, ``[kv_heads *
head_dim]``) — not per head as in Qwen3 — then q, k and v are clamped to
``[-clip_qkv, clip_qkv]`` when the config sets it, then RoPE. Every layer is
sparse: softmax then top-k, renormalized only when ``norm_topk_prob``
(default off), experts of width ``intermediate_size``.
"""

from __future__ import annotations

from typing import Any

import torch

from servelab.models.config import ModelConfig
from servelab.models.layers import RMSNorm, apply_rotary
from servelab.models.llama import LlamaAttention, LlamaForCausalLM
from servelab.models.step_attention import StepAttention
from servelab.moe.model import MoEModelMixin, moe_model_config


class OlmoeAttention(LlamaAttention):
    """:class:`LlamaAttention` with full-width ``q_norm`` / ``k_norm`` and ``clip_qkv``."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype=None, device=None) -> None:
        super().__init__(config, layer_idx, dtype=dtype, device=device)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.clip_qkv = getattr(config.hf_config, "clip_qkv", None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attention: StepAttention) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``; writes this step's K/V into ``kv_cache``."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = apply_rotary(q.reshape(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.reshape(n, self.num_kv_heads, self.head_dim), cos, sin)
        out = self.attend(q, k, v.reshape(n, self.num_kv_heads, self.head_dim), kv_cache, attention)
        return self.o_proj(out.reshape(n, self.q_size))


class OlmoeForCausalLM(MoEModelMixin, LlamaForCausalLM):
    """OLMoE decoder: :class:`LlamaForCausalLM` with :class:`OlmoeAttention` and sparse MoE blocks."""

    def __init__(self, config: ModelConfig, attention: Any = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(config, attention, dtype=dtype, device=device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = OlmoeAttention(config, i, dtype=dtype, device=device)
        self.install_moe(config, dtype=dtype, device=device)


def olmoe_config_from_hf(hf: Any, generation_config: Any = None) -> ModelConfig:
    """:class:`ModelConfig` for an ``olmoe`` config (q/k/v and o biased together by ``attention_bias``)."""
    return moe_model_config(hf, generation_config, like="qwen2")


__all__ = ["OlmoeAttention", "OlmoeForCausalLM", "olmoe_config_from_hf"]
