"""Helpers of the KV-connector tests: a tiny Gemma 2 checkpoint writer, a shared-prefix
workload, greedy outputs one request at a time."""

from __future__ import annotations

import random

import torch


def write_gemma2(path):
    """A tiny random Gemma 2 (sliding window 6, soft-capping) written by transformers."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    cfg = Gemma2Config(num_hidden_layers=4, sliding_window=6, query_pre_attn_scalar=12, attn_logit_softcapping=2.0,
                       final_logit_softcapping=4.0, vocab_size=96, hidden_size=32, intermediate_size=48,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


def shared_prefix_prompts(num: int, *, num_prefixes: int = 4, prefix_len: int = 24, vocab: int = 500,
                          seed: int = 0) -> list[list[int]]:
    """``num`` prompts over ``num_prefixes`` shared prefixes (round robin), each with a short own tail."""
    rng = random.Random(seed)
    prefixes = [[1] + [rng.randrange(3, vocab) for _ in range(prefix_len - 1)] for _ in range(num_prefixes)]
    return [prefixes[i % num_prefixes] + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 7))]
            for i in range(num)]


def one_by_one(pipe, prompts, params) -> list[tuple[int, ...]]:
    """Greedy outputs, one ``generate`` call per prompt (so earlier prompts' blocks get evicted)."""
    with torch.inference_mode():
        return [tuple(pipe.generate([p], params)[0].token_ids) for p in prompts]
