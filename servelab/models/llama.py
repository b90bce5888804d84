"""The Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache.

One class, :class:`LlamaForCausalLM`, covers the three HF architectures; they
differ only in config (q/k/v bias for Qwen2, a sliding window for Mistral and
some Qwen2 layers, tied embeddings, RoPE scaling), all read by
:class:`~servelab.models.config.ModelConfig`.

The forward pass takes the flat token axis of a mixed batch (see
:mod:`servelab.models.metadata`) and, in every layer, writes this step's K/V
into that layer's paged cache with ``attention.reshape_and_cache`` and then
reads the whole context back with ``attention.paged_attention``.
``attention`` is any object with those two methods: a backend from
:func:`servelab.attention.backends.get_attention_backend` (``"sdpa"``,
``"torch"`` — the references and the model's default — ``"triton"``, or
``"auto"``), the :mod:`servelab.reference` module itself, or a researcher's
own. The metadata is passed explicitly instead of through a global "forward
context" as in vLLM: easier to read and to call from a notebook. A backend's
per-step ``plan`` (index tensors, masks) is made once per forward and shared
by every layer, and the metadata's values are checked on the first layer only.

Parameter names follow HF (``model.layers.3.self_attn...``) except that
``q/k/v_proj`` are fused into ``qkv_proj`` and ``gate/up_proj`` into
``gate_up_proj`` (one GEMM each); the loader maps HF names onto them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from servelab.models import cpu_rope, decode_glue, quantized_decode_layers
from servelab.models.config import ModelConfig
from servelab.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary
from servelab.models.linear import Linear, PackedWeight, linear
from servelab.models.layer_api import qkv_slices, set_output_slices
from servelab.models.metadata import AttentionMetadata, GroupedAttentionMetadata
from servelab.models.step_attention import StepAttention, layer_attentions

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def resolve_attention(attention: Any = None, device: torch.device | str | None = None) -> Any:
    """Turn ``None`` / a backend name / an object with the two ops into the ops object.

    ``None`` means the PyTorch references (backend ``"torch"``); ``"auto"``
    means :func:`servelab.attention.backends.default_attention_backend` for
    ``device`` (``"sdpa"`` on a CPU); any other string is looked up with
    :func:`servelab.attention.backends.get_attention_backend`.
    """
    if attention is None:
        attention = "torch"
    if isinstance(attention, str):
        from servelab.attention.backends import default_attention_backend, get_attention_backend

        if attention == "auto":
            attention = default_attention_backend(device if device is not None else "cpu")
        return get_attention_backend(attention)
    missing = [op for op in ("reshape_and_cache", "paged_attention") if not callable(getattr(attention, op, None))]
    if missing:
        raise TypeError(
            f"attention must be a backend name or an object with reshape_and_cache and paged_attention; "
            f"{type(attention).__name__} lacks {', '.join(missing)}"
        )
    return attention


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` ``[T, heads, D]`` with the tables of :meth:`StepAttention.rope_tables`.

    Bit-identical to :func:`servelab.models.layers.apply_rotary` in four ops
    instead of nine: ``rotate_half(x) * sin`` is ``cat(-x2, x1) * cat(s1, s2)``,
    and ``(-x2) * s1 == x2 * (-s1)`` exactly (IEEE rounding is sign-symmetric),
    so it equals ``roll(x, D/2) * cat(-s1, s2)``; the products and the sum are
    the same operations in the same order. On a CPU in float32 it is one C
    call with the same arithmetic (:mod:`servelab.models.cpu_rope`).
    """
    if cpu_rope.usable(x, cos, signed_sin):
        return cpu_rope._rope(x, cos, signed_sin)
    rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)
    return rotated.add_(x * cos)  # == x * cos + rotated exactly (IEEE addition commutes)


def _cache_state(caches: list) -> tuple | None:
    """Identity and in-place version of every cache tensor (``None`` for inference-mode
    tensors, which keep no version counter: never chained)."""
    try:
        return tuple((t.data_ptr(), t._version) for pair in caches for t in pair)
    except RuntimeError:
        return None


class LlamaAttention(nn.Module):
    """GQA self-attention of one layer: fused QKV projection, RoPE, paged cache, output projection."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype=None, device=None) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        # Rows: [q (num_heads*head_dim) | k (num_kv_heads*head_dim) | v (same)].
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias, **kw)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias, **kw)
        set_output_slices(self.qkv_proj, qkv_slices(self.q_size, self.kv_size))  # HF's q/k/v_proj (layer_api)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attention: StepAttention) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``; writes this step's K/V into ``kv_cache``."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k rotated in one call (same elementwise ops, so bit-identical to
        # rotating each): [T, num_heads + num_kv_heads, head_dim], then sliced.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = rotate(qk, *attention.rope_tables(cos, sin))
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]  # views (Tensor.split's Python wrapper is slower)
        v = qkv[:, self.q_size + self.kv_size:].reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attend(q, k, v, kv_cache, attention)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               attention: StepAttention) -> torch.Tensor:
        """Write ``k``, ``v`` ``[T, num_kv_heads, head_dim]`` into ``kv_cache``, then attend ``q``
        ``[T, num_heads, head_dim]`` over it -> ``[T, num_heads, head_dim]`` (also the glued layer's)."""
        kv_scales: list[torch.Tensor]  # (k_scale, v_scale) for a quantized cache, else empty
        key_cache, value_cache, *kv_scales = kv_cache
        if kv_scales:  # a decode step's later layers: the write and the C kernel in direct calls
            out = attention.quantized_attend(k, v, q, key_cache, value_cache, *kv_scales, scale=self.scale,
                                             sliding_window=self.sliding_window)
        else:
            out = attention.carried_attend(k, v, q, key_cache, value_cache, scale=self.scale,
                                           sliding_window=self.sliding_window)
        if out is not None:
            return out
        # Write first: this step's queries attend to this step's keys too.
        attention.reshape_and_cache(k, v, key_cache, value_cache, *kv_scales)
        return attention.paged_attention(q, key_cache, value_cache, *kv_scales, scale=self.scale,
                                         sliding_window=self.sliding_window)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype=None, device=None) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.self_attn = LlamaAttention(config, layer_idx, **kw)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, **kw)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def forward(self, x, cos, sin, kv_cache, attention: StepAttention) -> torch.Tensor:
        if not torch.is_grad_enabled():  # a decode step on a CPU: the same kernels, three C calls
            tables = attention.rope_tables(cos, sin)  # (models/decode_glue.py); built once per step
            glue = decode_glue.parts(self, x, tables, LlamaAttention)
            if glue is not None:
                return decode_glue.forward(glue, x, *tables, kv_cache, attention)
        # Unfused residual adds (not vLLM's fused add+norm) so that bf16 rounds
        # exactly as HF does.
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attention)
        if torch.is_grad_enabled():
            h = x + h
            return h + self.mlp(self.post_attention_layernorm(h))
        # Inference: add into the fresh projection outputs (a + b == b + a exactly,
        # so bit-identical) instead of allocating [T, hidden] twice per layer.
        h = h.add_(x)
        return self.mlp(self.post_attention_layernorm(h)).add_(h)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig, *, dtype=None, device=None) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, **kw) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Mistral decoder with a language-model head.

    Build with :func:`servelab.models.load_model` (weights from a checkpoint)
    or directly from a :class:`ModelConfig` (parameters uninitialized when
    ``device="meta"``; ``load_weights`` fills them).

    Args:
        config: validated model config.
        attention: ops object or backend name (see :func:`resolve_attention`);
            swap it later by assigning ``model.attention = "triton"`` (or an object).
        dtype, device: of the parameters (activations follow).

    Attributes:
        check_inputs: when True (default) ``forward`` checks token ids against
            the vocabulary (one host sync) and the first layer's attention
            checks the metadata (shapes and values: slot and block ranges);
            set False in tight loops whose metadata is built correctly (the
            pipeline does).
        pack_weights: when True (default) the linear layers and the LM head run on
            weights packed for oneDNN on a CPU (:mod:`servelab.models.linear`); set
            it with :func:`servelab.models.linear.set_weight_packing`.
    """

    def __init__(self, config: ModelConfig, attention: Any = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.attention = attention  # resolved by the property setter
        self.check_inputs = True
        self.pack_weights = True
        self.model = LlamaModel(config, dtype=dtype, device=device)
        # Tied: the head reuses embed_tokens.weight (no second parameter, so
        # tying survives .to() / to_empty()).
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(config)

    @property
    def attention(self) -> Any:
        """The attention ops object; assigning a backend name or object resolves it
        (``"auto"`` is resolved for the model's device when first read there)."""
        if self._attention_auto and self._attention_device != self.device:
            object.__setattr__(self, "_attention", resolve_attention("auto", self.device))
            object.__setattr__(self, "_attention_device", self.device)
        elif self._attention is None:  # the default (the references), resolved on first use only, so
            object.__setattr__(self, "_attention", resolve_attention(None))  # a pipeline that swaps it
        return self._attention                                               # never imports them

    @attention.setter
    def attention(self, value: Any) -> None:
        auto = isinstance(value, str) and value == "auto"
        object.__setattr__(self, "_attention_auto", auto)
        object.__setattr__(self, "_attention_device", None)
        object.__setattr__(self, "_attention", None if auto or value is None else resolve_attention(value))

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[vocab, hidden]``: ``lm_head.weight``, or ``embed_tokens.weight`` when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: KVCaches | Any, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Run one step of a mixed batch; returns the final hidden states.

        Args:
            input_ids: int64 ``[T]``, this step's tokens of all sequences, flat.
            positions: int64 ``[T]``, absolute position of each token.
            kv_caches: per layer ``(key_cache, value_cache)``, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the
                model dtype (or the :class:`~servelab.blocks.KVCacheBuffers`
                from :func:`~servelab.models.allocate_kv_caches`); written in place.
            attn_metadata: slot mapping, block table, seq_lens, query_start_loc; or a
                :class:`~servelab.models.metadata.GroupedAttentionMetadata` (one per
                KV-cache group; layer ``i`` uses group ``layer_groups[i]``'s).

        Returns:
            ``[T, hidden_size]`` in the model dtype, after the final norm; pick
            rows (``attn_metadata.logits_indices()``) and call :meth:`compute_logits`.
        """
        caches = list(getattr(kv_caches, "views", kv_caches))
        self._check(input_ids, positions, caches, attn_metadata)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, attn_metadata.seq_lens, attn_metadata.query_start_loc,
                                   dtype=x.dtype)
        if type(attn_metadata) is GroupedAttentionMetadata:  # several KV-cache groups: a view per layer
            for layer, kv_cache, attention in zip(self.model.layers, caches,
                                                  layer_attentions(StepAttention, self.attention, attn_metadata)):
                x = layer(x, cos, sin, kv_cache, attention)
            return self.model.norm(x)
        ops = self.attention
        chain = "plan_chaining" in getattr(getattr(ops, "capabilities", None), "features", ())
        chain = chain and not (caches and len(caches[0]) > 2)  # no carried K/V over quantized pages
        attention = StepAttention(ops, attn_metadata, caches[0][0].shape[1] if caches else 1,
                                   check_values=self.check_inputs, chain=chain,
                                   previous_plans=self._previous_plans(ops, caches) if chain else None)
        tables = None if torch.is_grad_enabled() else attention.rope_tables(cos, sin)
        glued = None if tables is None else decode_glue.step_parts(self.model.layers, x, tables, LlamaDecoderLayer,
                                                                    LlamaAttention)
        if glued and tables is not None and len(glued) == len(caches):  # a CPU decode step: each layer's glue
            x = decode_glue.forward(glued[0], x, *tables, caches[0], attention)
            # Over int8 pages, the later layers' calls prepared at once (quantized_decode_layers).
            direct = quantized_decode_layers.prepare(self.model.layers, glued[1:], x, tables, caches[1:], attention)
            if direct is not None:
                x = direct.run()
            else:
                for glue, kv_cache in zip(glued[1:], caches[1:]):
                    x = decode_glue.forward(glue, x, *tables, kv_cache, attention)
        else:
            for layer, kv_cache in zip(self.model.layers, caches):
                x = layer(x, cos, sin, kv_cache, attention)
        if chain:
            state = _cache_state(caches)
            if state is not None:
                object.__setattr__(self, "_plan_memory", (ops, state, attention.plans))
        return self.model.norm(x)

    def _previous_plans(self, ops: Any, caches: list) -> dict | None:
        """The last forward's plans, if it completed with the same backend and caches and
        no cache tensor was modified in place since (torch's version counters); taken once."""
        memory = self.__dict__.get("_plan_memory")
        if memory is None:
            return None
        self.reset_attention_state()  # a forward that raises leaves nothing to chain from
        last_ops, last_state, plans = memory
        if last_ops is not ops or last_state != _cache_state(caches):
            return None
        return plans

    def reset_attention_state(self) -> None:
        """Drop what the attention backend carries between forwards (the ``"sdpa"``
        backend's dense decode K/V, up to ``servelab.attention.decode_kv.BUDGET_BYTES``).

        Never needed for correctness when caches are written through torch
        (in-place writes are detected); call it after writing a cache by other
        means (raw pointers, ``.data``, numpy views), or to free the memory
        when a batch ends (the pipeline does when it runs out of requests).
        """
        self.__dict__.pop("_plan_memory", None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 logits ``[n, vocab_size]`` (GEMM in the model dtype, as HF)."""
        return self.lm_head_gemm(hidden_states).float()

    def lm_head_gemm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab_size]`` in the model dtype: the LM-head GEMM on
        :attr:`lm_head_weight`, packed on a CPU like every :class:`~servelab.models.linear.Linear`
        (its own packed copy, so a tied embedding stays a plain lookup table)."""
        if self.lm_head is not None and not isinstance(self.lm_head, Linear):
            return self.lm_head(hidden_states)  # a replaced head (quantized, wrapped) runs its own forward
        cache = self.__dict__.get("_lm_head_packed")
        if cache is None:
            cache = PackedWeight()
            object.__setattr__(self, "_lm_head_packed", cache)  # derived state: not a buffer
        if not self.pack_weights:
            cache.clear()
            return linear(hidden_states, self.lm_head_weight, None, None)
        return linear(hidden_states, self.lm_head_weight, None, cache)

    def _check(self, input_ids, positions, caches, metadata: AttentionMetadata) -> None:
        if input_ids.dim() != 1 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"input_ids must be a 1-D int64/int32 tensor [T], got shape {tuple(input_ids.shape)} "
                f"dtype {input_ids.dtype}"
            )
        if positions.shape != input_ids.shape:
            raise ValueError(
                f"positions shape {tuple(positions.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
            )
        if len(caches) != self.config.num_hidden_layers:
            raise ValueError(
                f"kv_caches has {len(caches)} entries; the model has {self.config.num_hidden_layers} layers"
            )
        if metadata.slot_mapping.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"attn_metadata.slot_mapping has {metadata.slot_mapping.shape[0]} entries for "
                f"{input_ids.shape[0]} tokens"
            )
        if self.check_inputs and input_ids.numel():
            low, high = int(input_ids.min()), int(input_ids.max())
            if low < 0 or high >= self.config.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
