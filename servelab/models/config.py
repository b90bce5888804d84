"""Model configuration: read a Hugging Face ``config.json`` and refuse what we can't run.

:class:`ModelConfig` is the flat, validated view of a Llama-family config
the model is built from. It is produced by :func:`load_config` (a local
checkpoint folder, through ``transformers.AutoConfig``) or
:meth:`ModelConfig.from_hf` (a config object in memory). Anything the decoder
does not implement — another architecture, a non-SiLU activation, mixture of
experts, an unknown RoPE type, quantized weights, logit soft-capping... —
raises ``ValueError`` naming the field and its value, so a checkpoint never
runs with a silently different computation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# model_type -> the HF causal-LM class names that model_type may declare.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# Fields whose presence (non-empty / non-zero) means a feature the decoder lacks.
_UNSUPPORTED_FIELDS = {
    "num_local_experts": "mixture-of-experts layers",
    "num_experts": "mixture-of-experts layers",
    "n_routed_experts": "mixture-of-experts layers",
    "moe_intermediate_size": "mixture-of-experts layers",
    "quantization_config": "quantized weights",
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "cross_attention_layers": "cross-attention layers",
    "use_qk_norm": "query/key normalization",
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder needs, validated. Build with :meth:`from_hf` or :func:`load_config`.

    Attributes:
        arch: ``"llama"``, ``"qwen2"`` or ``"mistral"`` (HF ``model_type``).
        head_dim: per-head size; the config's ``head_dim`` when present, else
            ``hidden_size // num_attention_heads``.
        qkv_bias, o_bias, mlp_bias: which projections carry a bias (Qwen2: q/k/v;
            Llama with ``attention_bias``: q/k/v/o; Llama ``mlp_bias``: MLP).
        sliding_windows: per layer, the window ``w`` (position p sees keys
            j with p - j < w) or ``None`` for full attention.
        rope_type, rope_theta: RoPE variant and base; the scaling parameters
            are read from ``hf_config`` when the frequencies are computed.
        eos_token_ids: all end-of-sequence ids the config lists (may be empty).
        dtype: the checkpoint's declared dtype (``None`` if absent).
        hf_config: the transformers config object (kept for RoPE init).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]
    rope_type: str
    rope_theta: float
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    dtype: torch.dtype | None
    hf_config: Any = field(default=None, repr=False, compare=False)

    @property
    def sliding_window(self) -> int | None:
        """The window if *every* layer uses the same one, else ``None``."""
        windows = set(self.sliding_windows)
        return windows.pop() if len(windows) == 1 else None

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Validate a ``transformers`` config object and flatten it.

        Raises:
            ValueError: naming the first unsupported field and its value.
        """
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        expected = SUPPORTED_ARCHITECTURES[model_type]
        for name in getattr(hf, "architectures", None) or []:
            if name != expected:
                raise ValueError(
                    f"architectures={hf.architectures!r} is not supported for model_type={model_type!r}; "
                    f"expected [{expected!r}]"
                )
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; only 'silu' (SwiGLU MLP)")
        for name, what in _UNSUPPORTED_FIELDS.items():
            value = getattr(hf, name, None)
            if value not in (None, 0, False, {}, []):
                raise ValueError(f"{name}={value!r} is not supported ({what})")
        partial = getattr(hf, "partial_rotary_factor", None)
        rope = _rope_dict(hf)
        partial = rope.get("partial_rotary_factor", partial)
        if partial not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor={partial!r} is not supported; only 1.0 (full rotary)")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type={rope_type!r} (rope_parameters/rope_scaling) is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
        theta = 10000.0 if theta is None else float(theta)

        hidden, heads = _pos_int(hf, "hidden_size"), _pos_int(hf, "num_attention_heads")
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise ValueError(
                f"num_key_value_heads={kv_heads!r} must be a positive divisor of num_attention_heads={heads}"
            )
        head_dim = getattr(hf, "head_dim", None) or hidden // heads
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim={head_dim!r} must be a positive even integer (RoPE rotates pairs)")
        num_layers = _pos_int(hf, "num_hidden_layers")

        attention_bias = bool(getattr(hf, "attention_bias", False))
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        if model_type == "llama":
            qkv_bias = o_bias = attention_bias
        elif model_type == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 always biases q/k/v, never o
            if mlp_bias:
                raise ValueError(f"mlp_bias={mlp_bias!r} is not supported for model_type='qwen2'")
        else:
            qkv_bias = o_bias = False
            for name, value in (("attention_bias", attention_bias), ("mlp_bias", mlp_bias)):
                if value:
                    raise ValueError(f"{name}={value!r} is not supported for model_type='mistral'")

        windows = _sliding_windows(hf, model_type, num_layers)
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return cls(
            arch=model_type,
            vocab_size=_pos_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_pos_int(hf, "intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
            max_position_embeddings=_pos_int(hf, "max_position_embeddings"),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_windows=windows,
            rope_type=rope_type,
            rope_theta=theta,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            pad_token_id=getattr(hf, "pad_token_id", None),
            dtype=dtype if isinstance(dtype, torch.dtype) else None,
            hf_config=hf,
        )


def load_config(path: str | Path) -> ModelConfig:
    """Read ``path/config.json`` with ``transformers.AutoConfig`` (local files only) and validate it."""
    from transformers import AutoConfig

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a checkpoint folder: config.json not found")
    try:
        hf = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - unknown model_type, HF's own validators, bad JSON...
        raise ValueError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    return ModelConfig.from_hf(hf)


def _rope_dict(hf: Any) -> dict:
    """The RoPE parameters whichever way the config stores them (5.x: rope_parameters, 4.x: rope_scaling)."""
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters={rope!r} must be a dict")
    nested = [k for k in rope if k in _LAYER_TYPES]
    if nested:
        raise ValueError(f"rope_parameters per layer type ({nested}) are not supported; use one dict")
    return rope


def _pos_int(hf: Any, name: str) -> int:
    value = getattr(hf, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def _sliding_windows(hf: Any, model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer window, following each HF model's rule for which layers slide."""
    window = getattr(hf, "sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"sliding_window={window!r} must be a positive integer or null")
    if model_type == "llama":
        # HF's Llama ignores these fields; refusing is safer than a silent mismatch.
        if window is not None:
            raise ValueError(f"sliding_window={window!r} is not supported for model_type='llama'")
        return (None,) * num_layers
    if model_type == "mistral":
        return (window,) * num_layers  # Mistral slides on every layer (or none)
    # Qwen2: layer_types says which layers slide (transformers 5 derives it from
    # use_sliding_window / max_window_layers); older configs only have those two.
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None:
        use = bool(getattr(hf, "use_sliding_window", False))
        first = getattr(hf, "max_window_layers", num_layers)
        layer_types = ["sliding_attention" if use and window is not None and i >= first else "full_attention"
                       for i in range(num_layers)]
    if len(layer_types) != num_layers or any(t not in _LAYER_TYPES for t in layer_types):
        raise ValueError(
            f"layer_types={layer_types!r} must list {num_layers} entries from {_LAYER_TYPES}"
        )
    if "sliding_attention" in layer_types and window is None:
        raise ValueError("layer_types has 'sliding_attention' layers but sliding_window is null")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)
