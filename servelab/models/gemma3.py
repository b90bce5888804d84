"""Gemma 3 (text) over the paged KV cache: interleaved local / global attention, q/k norm, two RoPE bases.

What differs from Gemma 2 (:mod:`servelab.models.gemma2`, whose norms, GeGLU
MLP, embedding scale and sandwich layers it reuses), each matching Hugging
Face's ``Gemma3ForCausalLM``:

- **Layers interleave** local (sliding-window) and global attention, 5:1 in
  the released models: ``layer_types`` of the config, or, in older configs,
  ``sliding_window_pattern`` (every ``pattern``-th layer is global), which
  transformers turns into ``layer_types``. The local window is
  ``sliding_window`` (512 in Gemma 3 270M). On the pipeline, such a model
  gets the hybrid KV manager: one group of local layers (its blocks leave
  with the window), one of global layers.
- **q/k norm**: a Gemma RMSNorm (``1 + weight``) over ``head_dim`` on every
  query and key head, before RoPE (``self_attn.q_norm`` / ``k_norm``).
- **Two RoPE bases**: global layers rotate with ``rope_theta`` (1e6, and the
  checkpoint's scaling if any: ``rope_parameters["full_attention"]``), local
  layers with ``rope_local_base_freq`` (1e4, unscaled:
  ``rope_parameters["sliding_attention"]``).
- **Scale** ``query_pre_attn_scalar ** -0.5``; **no soft-capping** in the
  released models (a config that sets ``attn_logit_softcapping`` /
  ``final_logit_softcapping`` gets it, as in Gemma 2).

Registered as ``Gemma3ForCausalLM`` (model_type ``gemma3_text``; GGUF
``gemma3``) in :mod:`servelab.models.registry`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from servelab.models.config import ModelConfig, derived_config
from servelab.models.gemma2 import (
    _GEMMA_STAND_INS,
    Gemma2Attention,
    Gemma2ForCausalLM,
    GemmaRMSNorm,
    SoftcapStepAttention,
    check_gemma_features,
)
from servelab.models.layers import RotaryEmbedding
from servelab.models.llama import layer_attentions
from servelab.models.metadata import AttentionMetadata, GroupedAttentionMetadata
from servelab.models.qwen3 import Qwen3Attention

_LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope_by_layer_type(hf: Any) -> dict[str, dict]:
    """``rope_parameters`` per layer type, from a 5.x nested dict or 4.x fields."""
    rope = getattr(hf, "rope_parameters", None) or {}
    if isinstance(rope, dict) and set(rope) <= set(_LAYER_TYPES) and rope:
        return {t: dict(rope.get(t) or {"rope_type": "default"}) for t in _LAYER_TYPES}
    scaling = getattr(hf, "rope_scaling", None) or {}
    full = {"rope_type": "default", **scaling, "rope_theta": getattr(hf, "rope_theta", 1_000_000.0)}
    return {"full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": getattr(hf, "rope_local_base_freq", 10_000.0)}}


def gemma3_config_from_hf(hf: Any, generation_config: Any = None) -> ModelConfig:
    """:class:`ModelConfig` for a ``gemma3_text`` transformers config.

    The shared fields are validated as Qwen2's (``layer_types`` says which
    layers slide) with the global layers' RoPE; the Gemma features as Gemma
    2's; the local RoPE must be unscaled; bidirectional attention is refused.
    The model reads the local base, scalar and soft-caps from ``hf_config``."""
    check_gemma_features(hf)
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported for gemma3_text (a causal decoder)")
    rope = _rope_by_layer_type(hf)
    local = rope["sliding_attention"]
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters['sliding_attention']={local!r} is not supported; the local layers' "
                         "RoPE must be 'default' (unscaled)")
    theta = local.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"rope_local_base_freq={theta!r} must be a positive number")
    stand_ins = {**_GEMMA_STAND_INS, "rope_parameters": rope["full_attention"]}
    return derived_config(hf, generation_config, replace=stand_ins)


class _GlobalRotaryEmbedding(RotaryEmbedding):
    """The global layers' RoPE: scaled variants read ``rope_parameters["full_attention"]``."""

    def _hf_init(self, device, seq_len: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        init = ROPE_INIT_FUNCTIONS[self.rope_type]
        extra = {} if seq_len is None else {"seq_len": seq_len}
        return init(self.config.hf_config, device, layer_type="full_attention", **extra)


class Gemma3Attention(Gemma2Attention):
    """:class:`~servelab.models.gemma2.Gemma2Attention` with ``q_norm`` / ``k_norm``
    (Gemma RMSNorm over ``head_dim``) before RoPE."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype=None, device=None) -> None:
        super().__init__(config, layer_idx, dtype=dtype, device=device)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)

    # Norm q and k per head, then RoPE, then paged attention: Qwen 3's forward, to the letter (the
    # differences from Qwen 3 live in __init__: Gemma RMSNorm, query_pre_attn_scalar in self.scale).
    forward = Qwen3Attention.forward


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text decoder; same interface as
    :class:`~servelab.models.llama.LlamaForCausalLM`. Local layers
    (``config.sliding_windows[i]`` set) rotate with ``local_rotary_emb``,
    global ones with ``rotary_emb``."""

    def __init__(self, config: ModelConfig, attention: Any = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(config, attention, dtype=dtype, device=device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = Gemma3Attention(config, i, dtype=dtype, device=device)
        local = _rope_by_layer_type(config.hf_config)["sliding_attention"]["rope_theta"]
        self.rotary_emb = _GlobalRotaryEmbedding(config)
        self.local_rotary_emb = RotaryEmbedding(dataclasses.replace(config, rope_type="default",
                                                                    rope_theta=float(local)))
        self.is_local = tuple(w is not None for w in config.sliding_windows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """int64 ``[T]`` ids and positions -> final hidden states ``[T, hidden]`` (model dtype)."""
        caches = list(getattr(kv_caches, "views", kv_caches))
        self._check(input_ids, positions, caches, attn_metadata)
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        rope_args = (positions, attn_metadata.seq_lens, attn_metadata.query_start_loc)
        rope = {False: self.rotary_emb(*rope_args, dtype=x.dtype),
                True: self.local_rotary_emb(*rope_args, dtype=x.dtype)}
        if type(attn_metadata) is GroupedAttentionMetadata:  # local and global layers in their own KV groups
            attentions = layer_attentions(SoftcapStepAttention, self.attention, attn_metadata, self.attn_softcap)
        else:
            attention = SoftcapStepAttention(self.attention, attn_metadata,
                                             caches[0][0].shape[1] if caches else 1, self.attn_softcap)
            attentions = [attention] * len(caches)
        for layer, kv_cache, attention, local in zip(self.model.layers, caches, attentions, self.is_local):
            cos, sin = rope[local]
            x = layer(x, cos, sin, kv_cache, attention)
        return self.model.norm(x)


__all__ = ["Gemma3Attention", "Gemma3ForCausalLM", "gemma3_config_from_hf"]
