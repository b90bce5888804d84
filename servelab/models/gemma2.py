"""Gemma 2 over the paged KV cache: alternating sliding-window / full layers, soft-capping.

What differs from the Llama decoder (:mod:`servelab.models.llama`), each
matching Hugging Face's ``Gemma2ForCausalLM``:

- **Layers alternate** sliding-window (even layers in HF's ``layer_types``)
  and full attention; the per-layer windows come from
  :attr:`~servelab.models.config.ModelConfig.sliding_windows`.
- **Attention logit soft-capping**: scores become
  ``cap * tanh(scale * q.k / cap)`` (``attn_logit_softcapping``), passed to the
  attention backend as ``softcap``. Backends that cannot express it refuse
  with the reason (``sdpa``: its fused kernel applies softmax to the raw
  scores, there is no hook for a tanh) — use ``"torch"`` or ``"triton"``.
- **Scale** ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``.
- **Final logit soft-capping**: ``logits = cap * tanh(logits / cap)``
  (``final_logit_softcapping``), in :meth:`Gemma2ForCausalLM.compute_logits`.
- **Norms**: Gemma's RMSNorm multiplies by ``1 + weight`` (computed in
  float32, weights stored zero-centred); four per layer (input,
  post-attention, pre-feedforward, post-feedforward), sandwiching both
  sub-blocks: ``h = x + post_attn(attn(input(x)))``,
  ``out = h + post_ff(mlp(pre_ff(h)))``.
- **Embedding scale** ``sqrt(hidden_size)``, rounded to the activation
  dtype first (as HF does), and a GeGLU MLP (``gelu_pytorch_tanh``).

Parameter names follow HF with the same fused ``qkv_proj`` / ``gate_up_proj``
as Llama, so :func:`servelab.models.load_model` loads HF checkpoints unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servelab.models.config import ModelConfig, derived_config
from servelab.models.layers import RotaryEmbedding, apply_rotary
from servelab.models.linear import Linear
from servelab.models.layer_api import gate_up_slices, qkv_slices, set_output_slices
from servelab.models.llama import LlamaForCausalLM
from servelab.models.step_attention import StepAttention, layer_attentions
from servelab.models.metadata import AttentionMetadata, GroupedAttentionMetadata


class GemmaRMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in float32, cast back
    to x's dtype at the end (Gemma's order, unlike Llama's); x ``[..., hidden]``."""

    def __init__(self, hidden_size: int, eps: float, *, dtype=None, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GeGLUMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``, gate and up fused (rows ``[:inter]`` = gate)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype=None, device=None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, dtype=dtype, device=device)
        set_output_slices(self.gate_up_proj, gate_up_slices(intermediate_size))  # HF's gate/up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class SoftcapStepAttention(StepAttention):
    """:class:`~servelab.models.step_attention.StepAttention` that also passes ``softcap``.

    Every layer goes through the public op (capability gate included), so a
    backend without soft-capping refuses on the first layer with its reason."""

    def __init__(self, ops: Any, metadata: AttentionMetadata, block_size: int, softcap: float | None) -> None:
        super().__init__(ops, metadata, block_size)
        self.softcap = softcap

    def paged_attention(self, query, key_cache, value_cache, k_scale=None, v_scale=None, *, scale: float,
                        sliding_window: int | None):
        m = self.metadata
        args = (query, key_cache, value_cache, m.block_table, m.seq_lens, m.query_start_loc)
        extra: dict[str, Any] = {}
        if k_scale is not None:  # a quantized cache (servelab.blocks.kv_quant)
            extra.update(k_scale=k_scale, v_scale=v_scale)
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        if sliding_window is not None:
            extra["sliding_window"] = sliding_window
        if not self.is_backend:
            return self.ops.paged_attention(*args, scale=scale, causal=True, **extra)
        if self.softcap is not None:
            reason = self.ops.supports(query, key_cache, sliding_window=sliding_window, softcap=self.softcap)
            if reason is not None:
                from servelab.attention.backends import UnsupportedInputError

                raise UnsupportedInputError(
                    f"{reason}: this model needs attention logit soft-capping (attn_logit_softcapping="
                    f"{self.softcap}); use attention backend 'torch' or 'triton'")
        if sliding_window not in self.plans:
            self.plans[sliding_window] = self.ops.plan(m.block_table, m.seq_lens, m.query_start_loc,
                                                       block_size=self.block_size, causal=True,
                                                       sliding_window=sliding_window)
        plan = self.plans[sliding_window]
        if plan is not None:
            extra["plan"] = plan
        check = sliding_window not in self.checked_read
        self.checked_read.add(sliding_window)
        return self.ops.paged_attention(*args, scale=scale, causal=True, check_inputs=check, **extra)


class Gemma2Attention(nn.Module):
    """GQA attention with Gemma 2's scale; soft-capping is applied by the step's ops."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype=None, device=None) -> None:
        super().__init__()
        hf = config.hf_config
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = float(hf.query_pre_attn_scalar) ** -0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        kw = dict(dtype=dtype, device=device)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias, **kw)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias, **kw)
        set_output_slices(self.qkv_proj, qkv_slices(self.q_size, self.kv_size))  # HF's q/k/v_proj (layer_api)

    def forward(self, x, cos, sin, kv_cache, attention: StepAttention) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``; writes this step's K/V into ``kv_cache``."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        kv_scales: list[torch.Tensor]  # (k_scale, v_scale) for a quantized cache, else empty
        key_cache, value_cache, *kv_scales = kv_cache
        attention.reshape_and_cache(k, v.reshape(n, self.num_kv_heads, self.head_dim), key_cache, value_cache,
                                    *kv_scales)
        out = attention.paged_attention(q, key_cache, value_cache, *kv_scales, scale=self.scale,
                                        sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(n, self.q_size))


class Gemma2DecoderLayer(nn.Module):
    """Sandwich norms: ``h = x + post_attn(attn(input(x)))``; ``h + post_ff(mlp(pre_ff(h)))``."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype=None, device=None) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        eps = config.rms_norm_eps
        self.self_attn = Gemma2Attention(config, layer_idx, **kw)
        self.mlp = GeGLUMLP(config.hidden_size, config.intermediate_size, **kw)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps, **kw)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps, **kw)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps, **kw)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps, **kw)

    def forward(self, x, cos, sin, kv_cache, attention) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attention))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 decoder with a (tied) language-model head; same interface as
    :class:`~servelab.models.llama.LlamaForCausalLM` (``forward``,
    ``compute_logits``, ``attention``), so the runner and pipeline use it as is.

    Attributes:
        attn_softcap: ``attn_logit_softcapping`` or None.
        final_softcap: ``final_logit_softcapping`` or None.
    """

    def __init__(self, config: ModelConfig, attention: Any = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        nn.Module.__init__(self)
        if config.hf_config is None:
            raise ValueError("Gemma2ForCausalLM needs ModelConfig.hf_config (soft-caps, query_pre_attn_scalar)")
        kw = dict(dtype=dtype, device=device)
        self.config = config
        self.attention = attention
        self.check_inputs = True
        self.pack_weights = True
        self.attn_softcap = config.hf_config.attn_logit_softcapping
        self.final_softcap = config.hf_config.final_logit_softcapping
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        self.model.layers = nn.ModuleList(Gemma2DecoderLayer(config, i, **kw)
                                          for i in range(config.num_hidden_layers))
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, bias=False, **kw)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.forward`: int64 ``[T]`` ids and positions ->
        final hidden states ``[T, hidden]`` in the model dtype."""
        caches = list(getattr(kv_caches, "views", kv_caches))
        self._check(input_ids, positions, caches, attn_metadata)
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        cos, sin = self.rotary_emb(positions, attn_metadata.seq_lens, attn_metadata.query_start_loc, dtype=x.dtype)
        if type(attn_metadata) is GroupedAttentionMetadata:  # sliding and full layers in their own KV groups
            attentions = layer_attentions(SoftcapStepAttention, self.attention, attn_metadata, self.attn_softcap)
        else:
            attention = SoftcapStepAttention(self.attention, attn_metadata,
                                             caches[0][0].shape[1] if caches else 1, self.attn_softcap)
            attentions = [attention] * len(caches)
        for layer, kv_cache, attention in zip(self.model.layers, caches, attentions):
            x = layer(x, cos, sin, kv_cache, attention)
        return self.model.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 ``[n, vocab]``, soft-capped by ``final_logit_softcapping``."""
        logits = self.lm_head_gemm(hidden_states)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()


def gemma2_config_from_hf(hf: Any, generation_config: Any = None) -> ModelConfig:
    """:class:`ModelConfig` for a ``gemma2`` transformers config (registered as
    ``Gemma2ForCausalLM``): GeGLU (``gelu_pytorch_tanh``), positive soft-caps or
    null, a positive ``query_pre_attn_scalar``; the shared fields as Qwen2's
    (``layer_types`` says which layers slide). The model reads the soft-caps
    and the scalar from ``hf_config``."""
    check_gemma_features(hf)
    return derived_config(hf, generation_config, replace=_GEMMA_STAND_INS)


# Gemma features the Llama reader would refuse, replaced by neutral stand-ins once checked.
_GEMMA_STAND_INS = {"hidden_act": "silu", "attn_logit_softcapping": None, "final_logit_softcapping": None}


def check_gemma_features(hf: Any) -> None:
    """``ValueError`` for a Gemma config field this decoder does not compute as HF does."""
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation={act!r} is not supported for {hf.model_type}; only 'gelu_pytorch_tanh'")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = getattr(hf, name, None)
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{name}={value!r} must be a positive number or null")
    scalar = getattr(hf, "query_pre_attn_scalar", None)
    if not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ValueError(f"query_pre_attn_scalar={scalar!r} must be a positive number")
