"""Model configuration: read a Hugging Face ``config.json`` and refuse what we can't run.

:class:`ModelConfig` is the flat, validated view of a config the model is
built from. It is produced by :func:`~servelab.models.loader.load_config` (a local checkpoint
folder, through ``transformers.AutoConfig``) or :meth:`ModelConfig.from_hf`
(a config object in memory), which hands the config to the reader its
architecture registered (:mod:`servelab.models.registry`):
:func:`llama_family_config` for Llama / Qwen2 / Mistral, and, for families
built on the same fields (Qwen3, Gemma 2, Gemma 3), their own reader over
:func:`derived_config`. Anything the decoder does not implement — an
unregistered architecture, a non-SiLU activation, mixture of experts, an
unknown RoPE type, quantized weights... — raises ``ValueError`` naming the
field and its value, so a checkpoint never runs with a silently different
computation.

End of sequence and generation defaults come from both files a checkpoint
may have: ``eos_token_id`` (an int or a list) of ``config.json`` *and* of
``generation_config.json`` are merged, config first, duplicates dropped, so a
model that lists extra end-of-turn ids only in its generation config still
stops on them. Every EOS id must lie in ``[0, vocab_size)``, else loading
fails with the value and the range. The sampling defaults of
``generation_config.json`` are kept in :attr:`ModelConfig.generation_defaults`
under :class:`~servelab.samplers.SamplingParams` names, the same fields vLLM
reads (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, and ``max_new_tokens`` as ``max_tokens``);
``do_sample`` is ignored as vLLM ignores it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from servelab.models.registry import architecture_for

# model_type values llama_family_config computes (one decoder class, see servelab.models.llama).
LLAMA_FAMILY = ("llama", "qwen2", "mistral")
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
GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json field -> SamplingParams field (vLLM's generation_config="auto" set).
GENERATION_DEFAULT_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder needs, validated. Build with :meth:`from_hf` or :func:`~servelab.models.loader.load_config`.

    Attributes:
        arch: the HF ``model_type`` (``"llama"``, ``"qwen3"``, ``"gemma3_text"``...).
        head_dim: per-head size; the config's ``head_dim`` when present, else
            ``hidden_size // num_attention_heads``.
        qkv_bias, o_bias, mlp_bias: which projections carry a bias (Qwen2: q/k/v;
            Llama with ``attention_bias``: q/k/v/o; Llama ``mlp_bias``: MLP).
        sliding_windows: per layer, the window ``w`` (position p sees keys
            j with p - j < w) or ``None`` for full attention.
        rope_type, rope_theta: RoPE variant and base; the scaling parameters
            are read from ``hf_config`` when the frequencies are computed.
        eos_token_ids: all end-of-sequence ids of ``config.json`` then of
            ``generation_config.json`` (may be empty), each in ``[0, vocab_size)``.
        dtype: the checkpoint's declared dtype (``None`` if absent).
        hf_config: the transformers config object (kept for RoPE init).
        generation_defaults: sampling defaults from ``generation_config.json``
            under ``SamplingParams`` names (read-only; empty when none), e.g.
            ``{"temperature": 0.6, "top_p": 0.9}``. Apply them with
            ``SamplingParams(**config.generation_defaults)``.
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
    generation_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), compare=False)
    architecture: str | None = None

    @property
    def sliding_window(self) -> int | None:
        """The window if *every* layer uses the same one, else ``None``."""
        windows = set(self.sliding_windows)
        return windows.pop() if len(windows) == 1 else None

    @classmethod
    def from_hf(cls, hf: Any, generation_config: Mapping[str, Any] | None = None) -> "ModelConfig":
        """Validate a ``transformers`` config object and flatten it.

        Args:
            hf: a transformers config (``LlamaConfig``...).
            generation_config: the parsed ``generation_config.json`` (a dict or
                a ``GenerationConfig``), whose EOS ids are added to the
                config's and whose sampling fields become ``generation_defaults``.

        Raises:
            ValueError: naming the first unsupported field and its value.
        """
        architecture = architecture_for(hf)  # by `architectures`, else model_type: ValueError if not served
        config = architecture.config_from_hf(hf, generation_config)
        return dataclasses.replace(config, architecture=architecture.name)


def llama_family_config(hf: Any, generation_config: Mapping[str, Any] | None = None) -> ModelConfig:
    """``config_from_hf`` of Llama, Qwen2 and Mistral (one decoder class,
    :class:`~servelab.models.LlamaForCausalLM`): see :meth:`ModelConfig.from_hf`."""
    model_type = getattr(hf, "model_type", None)
    if model_type not in LLAMA_FAMILY:
        raise ValueError(f"model_type={model_type!r} is not supported by the Llama-family reader; "
                         f"supported: {', '.join(LLAMA_FAMILY)}")
    _check_supported_features(hf, model_type)
    rope_type, theta = _rope_type_and_theta(hf)

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

    qkv_bias, o_bias, mlp_bias = _biases(hf, model_type)

    windows = _sliding_windows(hf, model_type, num_layers)
    vocab_size = _pos_int(hf, "vocab_size")
    gen = _generation_dict(generation_config)
    eos_ids = tuple(dict.fromkeys(_eos_ids(getattr(hf, "eos_token_id", None), "config.json", vocab_size)
                                  + _eos_ids(gen.get("eos_token_id"), GENERATION_CONFIG_FILE, vocab_size)))
    defaults = {ours: gen[theirs] for theirs, ours in GENERATION_DEFAULT_FIELDS.items()
                if gen.get(theirs) is not None}
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return ModelConfig(
        arch=model_type,
        vocab_size=vocab_size,
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
        generation_defaults=MappingProxyType(defaults),
    )


def derived_config(hf: Any, generation_config: Any = None, *, like: str = "qwen2",
                   replace: Mapping[str, Any] | None = None) -> ModelConfig:
    """:class:`ModelConfig` of a family built on the Llama decoder's fields
    (Qwen3, Gemma 2, Gemma 3): the shared fields are validated by
    :func:`llama_family_config` on a copy of ``hf`` presented as model_type
    ``like`` (``"qwen2"``: the ``layer_types`` rule for sliding layers),
    with the fields of ``replace`` set first (the family's own features,
    which its reader checks itself, replaced by neutral stand-ins). The
    result has ``arch = hf.model_type``, ``hf_config = hf``, and q/k/v and o
    biased together by ``attention_bias``."""
    proxy = copy.deepcopy(hf)
    object.__setattr__(proxy, "model_type", like)
    proxy.architectures = None
    for name, value in (replace or {}).items():
        setattr(proxy, name, value)
    if getattr(proxy, "mlp_bias", False):
        raise ValueError(f"mlp_bias=True is not supported for model_type={hf.model_type!r}")
    config = llama_family_config(proxy, generation_config)
    bias = bool(getattr(hf, "attention_bias", False))  # q/k/v and o together, as these families do
    return dataclasses.replace(config, arch=hf.model_type, hf_config=hf, qkv_bias=bias, o_bias=bias)


def _check_supported_features(hf: Any, model_type: str) -> None:
    """``ValueError`` naming the first field a Llama-family config sets that this decoder lacks."""
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; only 'silu' (SwiGLU MLP)")
    for name, what in _UNSUPPORTED_FIELDS.items():
        value = getattr(hf, name, None)
        if value not in (None, 0, False, {}, []):
            raise ValueError(f"{name}={value!r} is not supported ({what})")


def _rope_type_and_theta(hf: Any) -> tuple[str, float]:
    """The RoPE variant and base (full rotary only); ``ValueError`` for what is not supported."""
    rope = _rope_dict(hf)
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported; only 1.0 (full rotary)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} (rope_parameters/rope_scaling) is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    return rope_type, 10000.0 if theta is None else float(theta)


def _biases(hf: Any, model_type: str) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o bias, MLP bias) by architecture: Qwen2 always biases q/k/v and never o."""
    attention_bias = bool(getattr(hf, "attention_bias", False))
    mlp_bias = bool(getattr(hf, "mlp_bias", False))
    if model_type == "llama":
        return attention_bias, attention_bias, mlp_bias
    if model_type == "qwen2":
        if mlp_bias:
            raise ValueError(f"mlp_bias={mlp_bias!r} is not supported for model_type='qwen2'")
        return True, False, False
    for name, value in (("attention_bias", attention_bias), ("mlp_bias", mlp_bias)):
        if value:
            raise ValueError(f"{name}={value!r} is not supported for model_type='mistral'")
    return False, False, False


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    """``folder/generation_config.json`` as a dict ({} when absent); bad JSON -> ValueError naming the file."""
    file = Path(folder) / GENERATION_CONFIG_FILE
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _generation_dict(generation_config: Any) -> dict[str, Any]:
    if generation_config is None:
        return {}
    if isinstance(generation_config, Mapping):
        return dict(generation_config)
    if hasattr(generation_config, "to_dict"):  # a transformers GenerationConfig
        return generation_config.to_dict()
    raise TypeError(f"generation_config must be a dict or a GenerationConfig, got {type(generation_config).__name__}")


def _eos_ids(value: Any, source: str, vocab_size: int) -> tuple[int, ...]:
    """``eos_token_id`` (None, an int or a list of ints) as a tuple, each checked against the vocabulary."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < vocab_size:
            raise ValueError(f"eos_token_id={value!r} in {source} is invalid: {item!r} is outside the "
                             f"vocabulary; valid: ints in [0, {vocab_size}) (vocab_size={vocab_size})")
    return tuple(items)


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
