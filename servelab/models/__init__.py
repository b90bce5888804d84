"""Models: decoders that load Hugging Face checkpoint folders (``config.json`` +
``*.safetensors``, or a ``.gguf`` file) and run attention over the paged KV
cache, chosen by the checkpoint's architecture through one registry
(:mod:`.registry`): Llama, Qwen2 and Mistral (one Llama-family decoder),
Qwen3, Gemma 2 and Gemma 3 (sliding and full layers: the hybrid KV manager);
and ``build_tiny_model`` for random tiny checkpoints (the demo's default and
the tests' fixtures).

>>> path = build_tiny_model(tmp / "tiny", arch="mistral")
>>> model, config = load_model(path)                  # float32 on CPU
>>> caches = allocate_kv_caches(model, num_blocks=64, block_size=16)
>>> ids, pos, meta = prepare_inputs([[1, 5, 9], [1, 7]], [0, 0], [[3], [7]], 16)
>>> hidden = model(ids, pos, caches, meta)           # [5, hidden]
>>> logits = model.compute_logits(hidden[meta.logits_indices()])  # [2, vocab] fp32

Adding an architecture: one model file and one
:func:`register_model_architecture` call (see :mod:`.registry`).

Modules: :mod:`.registry` (architecture -> decoder class + config reader),
:mod:`.config` (validation), :mod:`.layers` (RMSNorm, RoPE, MLP),
:mod:`.llama` (the Llama-family decoder), :mod:`.qwen3`, :mod:`.gemma2`,
:mod:`.gemma3`, :mod:`.metadata` (per-step inputs), :mod:`.loader`
(weights, KV-cache sizing), :mod:`.gguf` and :mod:`.hub` (real checkpoints),
:mod:`.tiny` and :mod:`.tokenizer` (the embedded tiny checkpoint).
"""

from servelab.models.config import SUPPORTED_ROPE_TYPES, ModelConfig
from servelab.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from servelab.models.llama import LlamaForCausalLM, resolve_attention
from servelab.models.loader import (
    allocate_kv_caches,
    checkpoint_files,
    kv_cache_spec,
    load_config,
    load_model,
    load_weights,
)
from servelab.models.metadata import AttentionMetadata, GroupedAttentionMetadata, prepare_inputs
from servelab.models.registry import (
    ModelArchitecture,
    available_model_architectures,
    get_model_architecture,
    model_class_for,
    register_model_architecture,
    supported_model_types,
)
from servelab.models.tiny import build_tiny_model, random_weights, tiny_config
from servelab.models.tokenizer import build_tiny_tokenizer, load_tokenizer

__all__ = [
    "AttentionMetadata", "GroupedAttentionMetadata", "LlamaForCausalLM", "ModelArchitecture", "ModelConfig",
    "RMSNorm", "RotaryEmbedding", "SUPPORTED_ROPE_TYPES", "SwiGLUMLP", "allocate_kv_caches",
    "available_model_architectures", "build_tiny_model", "build_tiny_tokenizer", "checkpoint_files",
    "get_model_architecture", "kv_cache_spec", "load_config", "load_model", "load_tokenizer", "load_weights",
    "model_class_for", "prepare_inputs", "random_weights", "register_model_architecture", "resolve_attention",
    "supported_model_types", "tiny_config",
]
