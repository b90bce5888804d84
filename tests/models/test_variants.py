"""Config variants against transformers: RoPE scaling types, tied/untied heads,
biases, odd head sizes, MQA, Qwen2 with some sliding layers."""

import pytest
import torch
from model_harness import ARCHS, ATOL, greedy_generate, hf_logits, load_hf, random_prompts, run_schedule

from servelab.blocks import FullAttentionSpec, SlidingWindowSpec
from servelab.models import build_tiny_model, kv_cache_spec, load_model

THETA = 10000.0
VARIANTS = {
    "rope_linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": THETA}}),
    # original_max_position_embeddings=64 puts the 16-dim head's frequencies in
    # all three llama3 bands (kept, smoothed, divided by the factor).
    "rope_llama3": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": THETA}}),
    "rope_yarn": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": THETA}}),
    "rope_yarn_qwen2": ("qwen2", {"rope_parameters": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128, "beta_fast": 16.0,
        "beta_slow": 2.0, "rope_theta": 1e6}}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2_untied": ("qwen2", {"tie_word_embeddings": False}),
    "llama_biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "head_dim_32_mqa": ("mistral", {"head_dim": 32, "num_key_value_heads": 1, "sliding_window": 8}),
    "mistral_no_window": ("mistral", {"sliding_window": None}),
    # Layer 0 full, layer 1 sliding (window 8): Qwen2's max_window_layers rule.
    "qwen2_mixed_window": ("qwen2", {"sliding_window": 8, "max_window_layers": 1}),
    "three_layers_gqa4": ("llama", {"num_hidden_layers": 3, "num_attention_heads": 8,
                                    "num_key_value_heads": 2, "head_dim": 8}),
}


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            arch, overrides = VARIANTS[name]
            path = build_tiny_model(tmp_path_factory.mktemp(name), arch=arch, seed=7, **overrides)
            model, config = load_model(path)
            cache[name] = (model, config, load_hf(path))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_hf(variant, name):
    model, config, hf = variant(name)
    seqs = random_prompts((3, 30, 47), config.vocab_size, seed=11)
    one, _, _ = run_schedule(model, seqs, (3, 30, 47), 10_000, 4, seed=1)
    chunked, _, mixed = run_schedule(model, seqs, (3, 12, 40), 9, 16, seed=2)
    assert mixed
    for seq, a, b in zip(seqs, one, chunked):
        ref = hf_logits(hf, seq)
        torch.testing.assert_close(a, ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(b, ref, atol=ATOL, rtol=0)


def test_variant_configs_are_what_they_say(variant):
    assert variant("rope_yarn")[1].rope_type == "yarn"
    assert variant("rope_yarn")[0].rotary_emb.attention_scaling > 1.0  # yarn's mscale is in play
    assert variant("llama_tied")[0].lm_head is None
    assert variant("qwen2_untied")[0].lm_head is not None
    assert variant("qwen2_mixed_window")[1].sliding_windows == (None, 8)
    assert variant("head_dim_32_mqa")[1].head_dim == 32
    assert variant("llama_biases")[0].model.layers[0].self_attn.o_proj.bias is not None


@pytest.mark.parametrize("name", ["rope_linear", "rope_llama3", "rope_yarn"])
def test_rope_scaling_changes_logits(variant, tmp_path, name):
    """Same weights (same arch, shapes and seed) with default RoPE give other
    logits, so the scaled variants above are really exercised."""
    model, config, _ = variant(name)
    plain, _ = load_model(build_tiny_model(tmp_path / "plain", arch="llama", seed=7))
    seq = random_prompts([40], config.vocab_size, seed=5)
    a, _, _ = run_schedule(model, seq, [40], 10_000, 16)
    b, _, _ = run_schedule(plain, seq, [40], 10_000, 16)
    assert (a[0] - b[0]).abs().max() > 1e-2


def test_dynamic_ntk_rope(tmp_path):
    """Dynamic NTK rescales once a sequence passes max_position_embeddings (32
    here): per sequence in a mixed batch, and step by step while decoding,
    as transformers does for one sequence."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}
    path = build_tiny_model(tmp_path / "dyn", arch="llama", seed=3, max_position_embeddings=32,
                            rope_parameters=rope)
    model, config = load_model(path)
    seqs = random_prompts((10, 45, 33), config.vocab_size, seed=2)
    got, _, _ = run_schedule(model, seqs, (10, 45, 33), 10_000, 4)
    for seq, logits in zip(seqs, got):
        torch.testing.assert_close(logits, hf_logits(load_hf(path), seq), atol=ATOL, rtol=0)
    # Decoding past the limit: a fresh HF model per prompt (its frequencies are stateful).
    prompts = random_prompts((30, 40), config.vocab_size, seed=4)
    ours = greedy_generate(model, prompts, max_new_tokens=8)
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = load_hf(path).generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                         do_sample=False, pad_token_id=0, eos_token_id=None)
        assert out == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_cache_spec(checkpoints, variant, arch):
    spec = kv_cache_spec(checkpoints[arch].config, block_size=16, dtype=torch.float32)
    if arch == "mistral":
        assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window == 16
    else:
        assert type(spec) is FullAttentionSpec
    assert (spec.num_kv_heads, spec.head_size, spec.block_size) == (2, 16, 16)
    # Mixed full/sliding layers: keep every block (the window is applied as a mask).
    assert type(kv_cache_spec(variant("qwen2_mixed_window")[1], 4)) is FullAttentionSpec
