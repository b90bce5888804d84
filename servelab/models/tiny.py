"""``build_tiny_model``: a random tiny checkpoint of any registered architecture, HF format, no network.

The folder it writes is what a real checkpoint looks like to both servelab
and transformers: ``config.json`` (saved by the transformers config class),
``model.safetensors`` (or shards + ``model.safetensors.index.json``) with HF
tensor names, a byte-level BPE tokenizer trained locally
(:mod:`servelab.models.tokenizer`) and ``generation_config.json``. It is the
embedded default of the demo and the fixture of the oracle tests.

Initialization is chosen so the model is *not* degenerate: every matrix,
embeddings included, is drawn with std ``1/sqrt(hidden or fan_in)`` so
attention scores and logits are O(1) (positions, windows and RoPE scaling
visibly change the output; a tied head is not a near-copy of the input
token), norms and biases are perturbed around their neutral values so loading
them is tested, and greedy continuations differ from prompt to prompt.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import torch

from servelab.models.registry import architecture_for, supported_model_types
from servelab.models.tokenizer import build_tiny_tokenizer

# A tied head reads the residual stream with the embedding matrix itself, so
# the input token's own embedding biases the next token towards a repeat.
# Shrinking tied embeddings weakens that bias; the final norm is scaled up by
# the same factor so logits keep their O(1) spread.
EMB_SCALE_TIED = 0.25
# Per-arch defaults on top of the shared tiny shape. Qwen2 ties its
# embeddings (like Qwen2-0.5B) and Llama/Mistral do not, so the default trio
# covers both; Mistral's window is small enough for short test prompts to pass it.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},
    "mistral": {"tie_word_embeddings": False, "sliding_window": 16},
    # Mixture of experts (servelab/moe): 8 experts, uneven top-k, small expert widths.
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 96, "norm_topk_prob": False},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2},
}


# Llama-family model types: their weights are drawn by random_weights (other
# families get transformers' own modules, re-drawn with the same scales).
_LLAMA_FAMILY = ("llama", "qwen2", "mistral")
# A small window for families that slide, so short test prompts pass it.
TINY_WINDOW = 16


def _architecture_name(arch: str) -> str:
    """The first registered HF architecture serving model_type ``arch``."""
    if arch not in supported_model_types():
        raise ValueError(f"arch={arch!r} is not supported; valid: {', '.join(supported_model_types())}")
    from transformers import AutoConfig

    return architecture_for(AutoConfig.for_model(arch)).name


def tiny_config(arch: str = "llama", vocab_size: int = 512, **overrides: Any):
    """The transformers config object ``build_tiny_model`` would save (nothing written).

    ``arch`` is a registered ``model_type`` (:func:`~servelab.models.supported_model_types`);
    the config class is transformers' for it, ``architectures`` its registered name."""
    from transformers import AutoConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        architectures=[_architecture_name(arch)], dtype="float32",
    )
    kwargs.update(_ARCH_DEFAULTS.get(arch, {}))
    if arch not in _LLAMA_FAMILY:  # the family's own RoPE bases (Gemma 3: one per layer type)
        del kwargs["rope_theta"]
        if getattr(AutoConfig.for_model(arch), "sliding_window", None):
            kwargs["sliding_window"] = TINY_WINDOW
    kwargs.update(overrides)
    if arch == "qwen2" and kwargs.get("sliding_window") is not None and "use_sliding_window" not in overrides:
        kwargs["use_sliding_window"] = True  # asking Qwen2 for a window means using it
    return AutoConfig.for_model(arch, **kwargs)


def _tensor_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a Llama-family config (no validation: a bad
    config still gets weights, so loaders can be tested on it)."""
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    model_type = cfg.model_type
    attn_bias = bool(getattr(cfg, "attention_bias", False))
    qkv_bias = model_type == "qwen2" or attn_bias
    o_bias = model_type != "qwen2" and attn_bias
    mlp_bias = bool(getattr(cfg, "mlp_bias", False))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for name, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                           ("v_proj", kv_heads * head_dim)):
            shapes[p + f"self_attn.{name}.weight"] = (rows, hidden)
            if qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (hidden,)
    if not getattr(cfg, "tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def random_weights(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded float32 weights with HF names for ``cfg`` (see module docstring for the scales)."""
    # The architecture is part of the seed, so llama and mistral (same tensor
    # shapes) do not share weights.
    gen = torch.Generator().manual_seed(zlib.crc32(f"{cfg.model_type}:{seed}".encode()))
    weights = {}
    for name, shape in _tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            if name == "model.norm.weight" and getattr(cfg, "tie_word_embeddings", False):
                tensor = tensor / EMB_SCALE_TIED
        elif name.endswith(".bias"):
            tensor = 0.1 * torch.randn(shape, generator=gen)
        else:
            tensor = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            if name == "model.embed_tokens.weight" and getattr(cfg, "tie_word_embeddings", False):
                tensor = tensor * EMB_SCALE_TIED
        weights[name] = tensor.contiguous()
    return weights


def _random_module_weights(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for any transformers causal LM ``cfg`` (names and
    shapes from transformers' own module), drawn with ``random_weights``' scales:
    matrices ``1/sqrt(fan_in)``, biases ``0.1``, norms their neutral value
    (0 for Gemma's ``1 + w``, 1 otherwise) plus ``0.1`` noise."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(zlib.crc32(f"{cfg.model_type}:{seed}".encode()))
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(cfg)
    weights = {}
    for name, param in module.state_dict().items():
        shape = tuple(param.shape)
        if "norm" in name:
            neutral = 0.0 if cfg.model_type.startswith("gemma") else 1.0
            tensor = neutral + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            tensor = 0.1 * torch.randn(shape, generator=gen)
        else:
            tensor = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        weights[name] = tensor.contiguous()
    if getattr(cfg, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    return weights


def save_weights(weights: dict[str, torch.Tensor], path: str | Path, num_shards: int = 1) -> None:
    """Write ``weights`` as ``model.safetensors``, or ``num_shards`` shards plus the HF index."""
    from safetensors.torch import save_file

    folder = Path(path)
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or not 1 <= num_shards <= len(weights):
        raise ValueError(f"num_shards={num_shards!r} must be an int in [1, {len(weights)}]")
    if num_shards == 1:
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    per_shard = math.ceil(len(names) / num_shards)
    weight_map, total = {}, 0
    for s in range(num_shards):
        chunk = names[s * per_shard:(s + 1) * per_shard]
        if not chunk:
            continue
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n] for n in chunk}, str(folder / file), metadata={"format": "pt"})
        for n in chunk:
            weight_map[n] = file
            total += weights[n].numel() * weights[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def build_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, *, num_shards: int = 1,
                     tokenizer_vocab_size: int = 512, **config_overrides: Any) -> Path:
    """Write a random tiny checkpoint folder at ``path`` and return it.

    Args:
        path: folder to create (or fill).
        arch: a registered ``model_type``: ``"llama"``, ``"qwen2"`` (q/k/v
            bias, tied embeddings), ``"mistral"`` (sliding window 16),
            ``"qwen3"``, ``"gemma2"``, ``"gemma3_text"`` (windows of 16)...
        seed: weights are a function of ``(arch, config, seed)`` only.
        num_shards: >1 writes sharded safetensors with an index file.
        tokenizer_vocab_size: BPE vocabulary size to train (>= 259).
        **config_overrides: any config field, e.g. ``num_hidden_layers=4``,
            ``tie_word_embeddings=True``, ``sliding_window=8``,
            ``rope_parameters={"rope_type": "linear", "factor": 2.0,
            "rope_theta": 10000.0}``. ``vocab_size`` defaults to the tokenizer's
            and may only be larger.

    Default shape: hidden 64, intermediate 128, 2 layers, 4 query heads, 2 KV
    heads, head_dim 16, max_position_embeddings 512, rope_theta 1e4, float32.
    Special tokens: pad 0, bos 1, eos 2.
    """
    from transformers import GenerationConfig

    _architecture_name(arch)  # refuses an arch no registered architecture serves
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_tiny_tokenizer(folder, vocab_size=tokenizer_vocab_size)
    requested = config_overrides.pop("vocab_size", vocab)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < vocab:
        raise ValueError(f"vocab_size={requested!r} must be an int >= the tokenizer's {vocab} tokens")
    cfg = tiny_config(arch, vocab_size=requested, **config_overrides)
    cfg.save_pretrained(str(folder))
    weights = random_weights(cfg, seed) if arch in _LLAMA_FAMILY else _random_module_weights(cfg, seed)
    save_weights(weights, folder, num_shards)
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     pad_token_id=cfg.pad_token_id).save_pretrained(str(folder))
    return folder
