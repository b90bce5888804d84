"""Gemma 2 and Qwen3 against transformers on tiny random checkpoints written by
transformers itself (``from_config`` + ``save_pretrained``): per-position
logits on a chunked, batched schedule and token-exact greedy generation, on
the attention backends that can express each model (sdpa refuses Gemma 2's
soft-capping with the reason). Prompts are longer than Gemma 2's window, so
the sliding layers really slide."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from model_harness import greedy_generate, hf_logits, load_hf, random_prompts, run_schedule  # noqa: E402

from servelab.attention.backends import UnsupportedInputError  # noqa: E402
from servelab.models import load_model  # noqa: E402

WINDOW = 6


def write_checkpoint(path, arch: str):
    from transformers import AutoModelForCausalLM, Gemma2Config, Qwen3Config

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if arch == "gemma2":
        hf_config = Gemma2Config(num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=12,
                                 attn_logit_softcapping=2.0, final_logit_softcapping=4.0, **common)
    else:
        hf_config = Qwen3Config(num_hidden_layers=2, tie_word_embeddings=False, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():  # Gemma's zero-initialized norms would hide the (1 + w) rule
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["gemma2", "qwen3"])
def ckpt(request, tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    model, config = load_model(path)
    return request.param, model, config, load_hf(path)


def test_config_reads_the_family(ckpt):
    arch, model, config, _ = ckpt
    assert config.arch == arch and type(model).__name__.lower().startswith(arch)
    if arch == "gemma2":
        assert config.sliding_windows == (WINDOW, None, WINDOW, None)
        assert model.attn_softcap == 2.0 and model.final_softcap == 4.0


def test_logits_match_transformers_on_a_chunked_batch(ckpt):
    arch, model, config, hf = ckpt
    model.attention = "torch"
    prompts = random_prompts([17, 11], config.vocab_size, seed=1)
    logits, _, mixed = run_schedule(model, prompts, [12, 5], budget=7, block_size=4)
    for seq, got in zip(prompts, logits):
        torch.testing.assert_close(got, hf_logits(hf, seq), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "sdpa", "triton"])
def test_greedy_is_token_exact(ckpt, backend):
    arch, model, config, hf = ckpt
    prompts = random_prompts([15, 9] if backend != "triton" else [9], config.vocab_size, seed=2)
    new = 8 if backend != "triton" else 3
    model.attention = backend
    try:
        if arch == "gemma2" and backend == "sdpa":
            with pytest.raises(UnsupportedInputError, match="soft-capping"):
                greedy_generate(model, prompts, new)
            return
        got = greedy_generate(model, prompts, new, eos_token_ids=config.eos_token_ids)
    finally:
        model.attention = "torch"
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=new, do_sample=False, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()


def test_gemma2_refuses_what_it_cannot_run(tmp_path):
    from transformers import Gemma2Config

    from servelab.models.config import ModelConfig

    bad = Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_activation="relu")
    with pytest.raises(ValueError, match="hidden_activation='relu'"):
        ModelConfig.from_hf(bad)


@pytest.mark.parametrize("setting", [
    dict(),  # defaults: auto backend (torch for Gemma 2: sdpa cannot softcap)
    dict(enable_prefix_caching=True, block_size=4, num_blocks=10, max_num_batched_tokens=16),
])  # kv_cache_groups="uniform" below; the hybrid path: tests/models/test_hybrid_pipeline.py
def test_pipeline_runs_gemma2_token_exact(ckpt, setting):
    """The pipeline with one uniform full-attention KV group (sliding layers
    apply their window as a mask): prefix caching on, a pool small enough to
    preempt, shared prefixes, prompts longer than the window."""
    from servelab import Pipeline, SamplingParams

    arch, model, config, hf = ckpt
    base = random_prompts([13], config.vocab_size, seed=3)[0]
    prompts = [base + random_prompts([n], config.vocab_size, seed=4 + n)[0][1:] for n in (5, 9, 2)] + [base[:9]]
    pipe = Pipeline(model, config=None, kv_cache_groups="uniform", **setting)
    outs = pipe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(out.token_ids) == want
    manager = pipe.kv_cache_manager
    assert manager.num_free_blocks == pipe.num_blocks - 1
    if setting:
        assert pipe.attention_backend == "torch" or arch == "qwen3"
        assert manager.prefix_cache_stats.hit_tokens > 0
        assert pipe.scheduler.num_preemptions > 0
