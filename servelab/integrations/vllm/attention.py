"""servelab's Triton paged attention as a vLLM v1 attention backend (GPU).

:class:`ServelabAttentionBackend` is vLLM's ``TritonAttentionBackend`` (its
metadata builder, KV-cache shape and capability declarations are reused
unchanged: ``query_start_loc``, ``seq_lens``, ``block_table``,
``slot_mapping`` are exactly what servelab's kernels take) with an
implementation whose ``forward`` calls servelab's kernels instead of vLLM's:
:func:`servelab.kernels.reshape_and_cache` to write the step's keys and values
and :func:`servelab.kernels.paged_attention` over the paged cache.

vLLM hands the cache as ``[num_blocks, num_kv_heads, block_size, 2 *
head_size]``; ``transpose(1, 2).split(head_size, -1)`` gives the NHD views
``[num_blocks, block_size, num_kv_heads, head_size]`` servelab's kernels
read (strided, no copy), the same views vLLM's own Triton kernels use.

Supported: decoder self-attention, causal, float16/bfloat16/float32 KV (no
fp8 / per-token-head quantization), no ALiBi, no attention sinks, no
multimodal prefix ranges, sliding window (left only) and softcap. Anything
else raises ``NotImplementedError`` when the layer is built, with the
reason — never a silent fallback to vLLM's kernels.

Registration goes through vLLM's backend registry (``register_backend``):
:func:`register` puts the class under ``AttentionBackendEnum.CUSTOM`` (or a
new name); select it with ``LLM(..., attention_config={"backend": "CUSTOM"})``.
servelab's ``vllm.general_plugins`` entry point
(:func:`servelab.integrations.vllm_plugin.load`) calls :func:`register` in every
engine process, but only when the user opts in with
``SERVELAB_VLLM_ATTENTION=1`` (needed when vLLM spawns worker processes);
otherwise it does nothing. Calling :func:`register` yourself is the other
opt-in (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps one process, which is what
``bench/gpu/vllm_integration.py`` does).
"""

from __future__ import annotations

from servelab.integrations.vllm._compat import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl  # noqa: E402

__all__ = ["ServelabAttentionBackend", "ServelabAttentionImpl", "register"]

CLASS_PATH = f"{__name__}.ServelabAttentionBackend"


class ServelabAttentionImpl(TritonAttentionImpl):
    """vLLM's attention-layer implementation, computed by servelab's kernels."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        reasons = []
        if getattr(self, "alibi_slopes", None) is not None:
            reasons.append("ALiBi")
        if getattr(self, "sinks", None) is not None:
            reasons.append("attention sinks")
        if getattr(self, "_is_per_token_head_quant", False) or "fp8" in str(getattr(self, "kv_cache_dtype", "")):
            reasons.append(f"kv_cache_dtype={self.kv_cache_dtype}")
        window = getattr(self, "sliding_window", (-1, -1))
        if window[1] not in (-1, 0):
            reasons.append(f"a two-sided sliding window {window}")
        if reasons:
            raise NotImplementedError("servelab's paged attention backend does not support " + ", ".join(reasons)
                                      + "; use vLLM's own backend for this model")
        self._servelab_window = None if window[0] < 0 else window[0] + 1
        cap = getattr(self, "logits_soft_cap", 0) or 0
        self._servelab_softcap = float(cap) if cap > 0 else None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        """``query`` ``[T, H, D]``, ``key``/``value`` ``[T, H_kv, D]``, ``kv_cache``
        ``[num_blocks, H_kv, block_size, 2 D]``; writes ``output`` ``[T, H * D]``."""
        from servelab.kernels import paged_attention, reshape_and_cache

        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("servelab's paged attention backend has no fused output quantization")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        if getattr(attn_metadata, "mm_prefix_range", None):
            raise NotImplementedError("servelab's paged attention backend has no multimodal prefix ranges")
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        reshape_and_cache(key[:n], value[:n], key_cache, value_cache, attn_metadata.slot_mapping[:n],
                          check_inputs=False)
        out = output[:n].view(n, self.num_heads, self.head_size)
        paged_attention(query[:n], key_cache, value_cache, attn_metadata.block_table, attn_metadata.seq_lens,
                        attn_metadata.query_start_loc, scale=self.scale, causal=True,
                        sliding_window=self._servelab_window, softcap=self._servelab_softcap, out=out,
                        check_inputs=False)
        return output


class ServelabAttentionBackend(TritonAttentionBackend):
    """vLLM's Triton attention backend with servelab's kernels (see the module docstring)."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[ServelabAttentionImpl]:
        return ServelabAttentionImpl

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False


def register(name: str = "CUSTOM") -> str:
    """Register :class:`ServelabAttentionBackend` in vLLM's backend registry under ``name``
    (``"CUSTOM"``: the member vLLM reserves for third-party backends); returns the name.
    Usable as a ``vllm.general_plugins`` entry point (called with no arguments)."""
    if name == "CUSTOM":
        register_backend(AttentionBackendEnum.CUSTOM, CLASS_PATH)
    else:
        register_backend(name, CLASS_PATH)
    return name


def _smoke() -> dict:
    """Import and registration wiring, no GPU: the class resolves through vLLM's registry."""
    register()
    resolved = AttentionBackendEnum.CUSTOM.get_class()
    return {"backend": resolved.__name__, "impl": resolved.get_impl_cls().__name__,
            "supports_head_size_64": resolved.supports_head_size(64), "torch": torch.__version__}
