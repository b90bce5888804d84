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

from servelab.models.config import ModelConfig
from servelab.models.layers import RMSNorm, apply_rotary
from servelab.models.llama import LlamaAttention, LlamaForCausalLM, _StepAttention


class Qwen3Attention(LlamaAttention):
    """:class:`LlamaAttention` with ``q_norm`` / ``k_norm`` (RMSNorm over ``head_dim``)."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype=None, device=None) -> None:
        super().__init__(config, layer_idx, dtype=dtype, device=device)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attention: _StepAttention) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``; writes this step's K/V into ``kv_cache``."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q.view(n, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), cos, sin)
        key_cache, value_cache = kv_cache
        attention.reshape_and_cache(k, v.reshape(n, self.num_kv_heads, self.head_dim), key_cache, value_cache)
        out = attention.paged_attention(q, key_cache, value_cache, scale=self.scale,
                                        sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(n, self.q_size))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 decoder: :class:`LlamaForCausalLM` whose layers use :class:`Qwen3Attention`."""

    def __init__(self, config: ModelConfig, attention: Any = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(config, attention, dtype=dtype, device=device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = Qwen3Attention(config, i, dtype=dtype, device=device)


def config_from_hf(hf: Any, generation_config: Any = None) -> ModelConfig:
    """:class:`ModelConfig` for a ``gemma2`` or ``qwen3`` transformers config.

    The shared fields are validated by :meth:`ModelConfig.from_hf` on a copy
    presented as Qwen2 (same ``layer_types`` rule for sliding layers); the
    family's own features are then checked here and the copy's stand-ins
    undone (``arch``, biases, ``hf_config`` = the original config, which the
    model reads for soft-caps and ``query_pre_attn_scalar``).
    """
    import copy
    import dataclasses

    model_type = getattr(hf, "model_type", None)
    if model_type not in ("gemma2", "qwen3"):
        raise ValueError(f"model_type={model_type!r}: config_from_hf handles 'gemma2' and 'qwen3'")
    proxy = copy.deepcopy(hf)
    object.__setattr__(proxy, "model_type", "qwen2")
    proxy.architectures = None
    if model_type == "gemma2":
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation={act!r} is not supported for gemma2; only 'gelu_pytorch_tanh'")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(hf, name, None)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive number or null")
            setattr(proxy, name, None)
        scalar = getattr(hf, "query_pre_attn_scalar", None)
        if not isinstance(scalar, (int, float)) or scalar <= 0:
            raise ValueError(f"query_pre_attn_scalar={scalar!r} must be a positive number")
        proxy.hidden_act = "silu"
    for name in ("architectures",):
        for arch in getattr(hf, name, None) or []:
            expected = "Gemma2ForCausalLM" if model_type == "gemma2" else "Qwen3ForCausalLM"
            if arch != expected:
                raise ValueError(f"architectures={hf.architectures!r} is not supported for "
                                 f"model_type={model_type!r}; expected [{expected!r}]")
    if getattr(proxy, "mlp_bias", False):
        raise ValueError(f"mlp_bias=True is not supported for model_type={model_type!r}")
    from servelab.models.config import ModelConfig

    config = ModelConfig.from_hf(proxy, generation_config)
    bias = bool(getattr(hf, "attention_bias", False))
    return dataclasses.replace(config, arch=model_type, qkv_bias=bias, o_bias=bias, hf_config=hf)


def model_class_for(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The decoder class for ``config.arch``."""
    if config.arch == "gemma2":
        from servelab.models.gemma2 import Gemma2ForCausalLM

        return Gemma2ForCausalLM
    if config.arch == "qwen3":
        return Qwen3ForCausalLM
    return LlamaForCausalLM
