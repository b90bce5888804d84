"""Qwen3: the Llama decoder plus a per-head RMSNorm on queries and keys.

Matching Hugging Face's ``Qwen3ForCausalLM``: after the QKV projection each
query head and each key head (``[T, heads, head_dim]``) is normalized over
``head_dim`` by its own RMSNorm (``self_attn.q_norm`` / ``self_attn.k_norm``,
weights ``[head_dim]``), *before* RoPE. No q/k/v bias unless
``attention_bias`` (then o_proj has one too). Sliding-window layers follow
``layer_types`` as for Qwen2. Everything else is
:class:`~servelab.models.llama.LlamaForCausalLM`.
"""

from __future__ import annotations

from typing import Any

import torch

from servelab.models.config import ModelConfig, derived_config
from servelab.models.layers import RMSNorm, apply_rotary
from servelab.models.llama import LlamaAttention, LlamaForCausalLM
from servelab.models.step_attention import StepAttention


class Qwen3Attention(LlamaAttention):
    """:class:`LlamaAttention` with ``q_norm`` / ``k_norm`` (RMSNorm over ``head_dim``)."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype=None, device=None) -> None:
        super().__init__(config, layer_idx, dtype=dtype, device=device)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attention: StepAttention) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``; writes this step's K/V into ``kv_cache``."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q.view(n, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), cos, sin)
        kv_scales: list[torch.Tensor]  # (k_scale, v_scale) for a quantized cache, else empty
        key_cache, value_cache, *kv_scales = kv_cache
        attention.reshape_and_cache(k, v.reshape(n, self.num_kv_heads, self.head_dim), key_cache, value_cache,
                                    *kv_scales)
        out = attention.paged_attention(q, key_cache, value_cache, *kv_scales, scale=self.scale,
                                        sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(n, self.q_size))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 decoder: :class:`LlamaForCausalLM` whose layers use :class:`Qwen3Attention`."""

    def __init__(self, config: ModelConfig, attention: Any = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(config, attention, dtype=dtype, device=device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = Qwen3Attention(config, i, dtype=dtype, device=device)


def qwen3_config_from_hf(hf: Any, generation_config: Any = None) -> ModelConfig:
    """:class:`ModelConfig` for a ``qwen3`` transformers config (registered as
    ``Qwen3ForCausalLM``): the shared fields as Qwen2's (same ``layer_types``
    rule for sliding layers), q/k/v and o biased together by ``attention_bias``."""
    return derived_config(hf, generation_config)
