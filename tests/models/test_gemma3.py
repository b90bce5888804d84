"""Gemma 3 (text) against transformers' ``Gemma3ForCausalLM`` on tiny random
checkpoints (``build_tiny_model(arch="gemma3_text")``, transformers' own
modules re-drawn): the config (5:1 local/global layers from ``layer_types``
or ``sliding_window_pattern``, two RoPE bases), per-position logits, and
greedy generation token-exact through the pipeline on the hybrid KV manager
(prefix caching, a pool small enough to preempt, prompts past the window),
on the torch, sdpa and triton backends. Each Gemma 3 feature is shown to
matter: the test fails when it is dropped."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from model_harness import PagedRunner, hf_logits, load_hf, random_prompts  # noqa: E402

from servelab import Pipeline, SamplingParams  # noqa: E402
from servelab.blocks import HybridKVCacheManager, SlidingWindowSpec  # noqa: E402
from servelab.models import ModelConfig, build_tiny_model, load_model, tiny_config  # noqa: E402

WINDOW = 6
LAYERS = 6  # 5 local, 1 global: the released models' 5:1 pattern


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("gemma3"), arch="gemma3_text", num_hidden_layers=LAYERS,
                            sliding_window=WINDOW, seed=3)
    model, config = load_model(path)
    return model, config, load_hf(path)


def _hf_greedy(hf, prompt, new):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_config_reads_the_interleaving_and_both_rope_bases(gemma3):
    model, config, _ = gemma3
    assert config.arch == "gemma3_text" and config.architecture == "Gemma3ForCausalLM"
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert config.sliding_windows == (WINDOW,) * 5 + (None,)
    assert config.rope_theta == 1_000_000.0 and model.local_rotary_emb.config.rope_theta == 10_000.0
    assert model.attn_softcap is None and model.final_softcap is None
    assert model.model.layers[0].self_attn.scale == 256 ** -0.5  # query_pre_attn_scalar, not head_dim
    # Older configs: sliding_window_pattern (every 3rd layer global) instead of layer_types.
    old = tiny_config("gemma3_text", num_hidden_layers=6, sliding_window_pattern=3, sliding_window=8)
    assert ModelConfig.from_hf(old).sliding_windows == (8, 8, None, 8, 8, None)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True is not supported"):
        ModelConfig.from_hf(tiny_config("gemma3_text", use_bidirectional_attention=True))


def _logits(model, prompt):
    return PagedRunner(model, block_size=4).step({0: prompt})[0]


def test_logits_match_transformers_and_each_feature_matters(gemma3):
    model, config, hf = gemma3
    prompt = random_prompts([23], config.vocab_size, seed=1)[0]  # past the window
    ref = hf_logits(hf, prompt)
    assert (_logits(model, prompt) - ref).abs().max() < 1e-4
    local_rope, layer = model.local_rotary_emb, model.model.layers[0].self_attn
    try:  # the local layers with the global base: a different model
        model.local_rotary_emb = model.rotary_emb
        assert (_logits(model, prompt) - ref).abs().max() > 1e-3
    finally:
        model.local_rotary_emb = local_rope
    weight = layer.q_norm.weight.clone()
    try:  # q norm off (weight -1 -> 1 + w = 0 would zero it; a neutral norm is weight 0): still a change
        layer.q_norm.weight.zero_()
        assert (_logits(model, prompt) - ref).abs().max() > 1e-3
    finally:
        layer.q_norm.weight.copy_(weight)
    windows = model.model.layers[0].self_attn.sliding_window
    try:  # no window on the local layers
        for lay in model.model.layers[:5]:
            lay.self_attn.sliding_window = None
        assert (_logits(model, prompt) - ref).abs().max() > 1e-3
    finally:
        for lay in model.model.layers[:5]:
            lay.self_attn.sliding_window = windows


@pytest.mark.parametrize("backend", ["torch", "sdpa", "triton"])
def test_pipeline_on_the_hybrid_manager_is_token_exact(gemma3, backend):
    model, config, hf = gemma3
    small = backend == "triton"  # the interpreter is slow: fewer, shorter requests
    base = random_prompts([14], config.vocab_size, seed=2)[0]
    prompts = [base + random_prompts([n], config.vocab_size, seed=10 + n)[0][1:] for n in (6, 11)] + [base[:10]]
    prompts = [prompts[2] + prompts[0][10:13]] if small else prompts  # 13 tokens: past the window
    new = 2 if small else 6
    try:
        pipe = Pipeline(model, attention_backend=backend, enable_prefix_caching=True, block_size=2,
                        num_blocks=40 if small else 36, max_num_batched_tokens=16)
        manager = pipe.kv_cache_manager
        assert isinstance(manager, HybridKVCacheManager)
        kinds = sorted(type(g.spec).__name__ for g in manager.groups)
        assert kinds.count("SlidingWindowSpec") == 5 and kinds.count("FullAttentionSpec") == 1
        outs = pipe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new))
        again = pipe.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=new))[0]
    finally:
        model.attention = "torch"
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == _hf_greedy(hf, prompt, new), (backend, out)
    assert list(again.token_ids) == list(outs[0].token_ids)
    if not small:  # shared prefixes were served from the cache, and the pool preempted
        assert manager.prefix_cache_stats.hit_tokens > 0 and pipe.scheduler.num_preemptions > 0
    assert manager.num_free_blocks == pipe.num_blocks - 1
    assert all(isinstance(g.spec, SlidingWindowSpec) == (g.layer_indices[0] < 5) for g in manager.groups)
