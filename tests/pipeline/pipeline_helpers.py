"""Helpers of the pipeline tests: prompts, the transformers oracle, leak checks."""

import torch

ARCHS = ("llama", "qwen2", "mistral")


def random_prompts(lengths, vocab_size: int = 512, seed: int = 0) -> list[list[int]]:
    """Token-id prompts (BOS first), avoiding the special ids 0..2 elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab_size, (n - 1,), generator=gen).tolist() for n in lengths]


_HF_CACHE: dict = {}


@torch.no_grad()
def hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    key = str(path)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(
            key, dtype=torch.float32, attn_implementation="eager", local_files_only=True).eval()
    model = _HF_CACHE[key]
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def assert_no_leaks(pipe) -> None:
    """Every KV block but the null block is free, and the runner forgot every request."""
    manager = pipe.kv_cache_manager
    assert manager.num_free_blocks == pipe.num_blocks - 1, (manager.num_free_blocks, pipe.num_blocks)
    assert not manager.req_to_blocks
    assert not pipe.runner.requests
    assert not pipe.scheduler.has_unfinished_requests()
    drafter = pipe.drafter
    if getattr(drafter, "kv_caches", None) is not None:
        assert drafter.num_free_blocks == drafter.num_blocks - 1
