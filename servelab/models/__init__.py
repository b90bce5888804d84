"""Models: a Llama-family decoder (Llama, Qwen2, Mistral) that loads Hugging
Face checkpoint folders (``config.json`` + ``*.safetensors``) and runs attention
over the paged KV cache, and ``build_tiny_model`` for random tiny checkpoints
(the demo's default and the tests' fixtures).

>>> path = build_tiny_model(tmp / "tiny", arch="mistral")
>>> model, config = load_model(path)                  # float32 on CPU
>>> caches = allocate_kv_caches(model, num_blocks=64, block_size=16)
>>> ids, pos, meta = prepare_inputs([[1, 5, 9], [1, 7]], [0, 0], [[3], [7]], 16)
>>> hidden = model(ids, pos, caches, meta)           # [5, hidden]
>>> logits = model.compute_logits(hidden[meta.logits_indices()])  # [2, vocab] fp32

Modules: :mod:`.config` (validation), :mod:`.layers` (RMSNorm, RoPE, MLP),
:mod:`.llama` (the decoder), :mod:`.metadata` (per-step inputs),
:mod:`.loader` (weights, KV-cache sizing), :mod:`.tiny` and
:mod:`.tokenizer` (the embedded tiny checkpoint).
"""

from servelab.models.config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelConfig, load_config
from servelab.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from servelab.models.llama import LlamaForCausalLM, resolve_attention
from servelab.models.loader import allocate_kv_caches, checkpoint_files, kv_cache_spec, load_model, load_weights
from servelab.models.metadata import AttentionMetadata, GroupedAttentionMetadata, prepare_inputs
from servelab.models.tiny import build_tiny_model, random_weights, tiny_config
from servelab.models.tokenizer import build_tiny_tokenizer, load_tokenizer

__all__ = [
    "AttentionMetadata", "GroupedAttentionMetadata", "LlamaForCausalLM", "ModelConfig", "RMSNorm",
    "RotaryEmbedding",
    "SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "SwiGLUMLP", "allocate_kv_caches",
    "build_tiny_model", "build_tiny_tokenizer", "checkpoint_files", "kv_cache_spec", "load_config",
    "load_model", "load_tokenizer", "load_weights", "prepare_inputs", "random_weights",
    "resolve_attention", "tiny_config",
]
