"""The pipeline over several KV-cache groups (``kv_cache_groups="auto"``):
Gemma 2 (alternating sliding / full layers) and a Qwen2 config whose upper
layers slide, on tiny random checkpoints written by transformers, token-exact
against transformers' greedy ``generate`` with prefix caching on, a pool small
enough to preempt, shared prefixes and prompts longer than the window; on the
torch backend, triton under the interpreter (small), and sdpa where it can
express the model (Gemma 2's soft-capping: refused with the reason). No KV
block leaks; the runner's per-group tables agree with the manager's."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from model_harness import load_hf, random_prompts  # noqa: E402
from test_gemma2_qwen3 import WINDOW, write_checkpoint  # noqa: E402

from servelab import Pipeline, SamplingParams  # noqa: E402
from servelab.blocks import (  # noqa: E402
    FullAttentionSpec,
    HybridKVCacheManager,
    KVCacheGroup,
    KVCacheManager,
    SlidingWindowSpec,
)
from servelab.blocks.specs import blocks_needed_alone  # noqa: E402
from servelab.models import build_tiny_model, load_model  # noqa: E402
from servelab.pipeline.hybrid import HybridModelRunner  # noqa: E402


def write_qwen2_sliding(path):
    """Qwen2 with ``use_sliding_window``: layers >= max_window_layers slide."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    hf_config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["gemma2", "qwen2"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(path, "gemma2") if request.param == "gemma2" else write_qwen2_sliding(path)
    model, config = load_model(path)
    return request.param, model, config, load_hf(path)


def _prompts(vocab_size: int, lengths=(5, 9, 2)) -> list[list[int]]:
    base = random_prompts([13], vocab_size, seed=3)[0]
    return [base + random_prompts([n], vocab_size, seed=4 + n)[0][1:] for n in lengths] + [base[:9]]


def _hf_greedy(hf, prompt, new):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _check_tables(pipe):
    """Each running request's row in each group's table holds exactly the manager's
    block ids (positions a sliding window released are the null block in both)."""
    manager, runner = pipe.kv_cache_manager, pipe.runner
    for rid, state in runner.requests.items():
        if state.row < 0 or rid not in manager.req_to_blocks:
            continue
        for g, ids in enumerate(manager.get_block_ids(rid)):
            row = runner._bts[g][state.row, :len(ids)].tolist()
            assert len(ids) == state.group_blocks[g]
            assert ids == row, (rid, g, ids, row)


def test_auto_builds_groups_per_layer_kind(ckpt):
    arch, model, config, _ = ckpt
    pipe = Pipeline(model, attention_backend="torch", block_size=4, num_blocks=40)
    manager = pipe.kv_cache_manager
    assert isinstance(manager, HybridKVCacheManager) and isinstance(pipe.runner, HybridModelRunner)
    sliding = (0, 2) if arch == "gemma2" else (2, 3)
    full = (1, 3) if arch == "gemma2" else (0, 1)
    by_kind = {type(g.spec): g.layer_indices for g in manager.groups}
    assert by_kind == {SlidingWindowSpec: sliding, FullAttentionSpec: full}
    # One shared buffer of group_size (2) layer tensors: a block id is a page in each.
    assert pipe.kv_cache_bytes == 40 * manager.groups[0].spec.page_size_bytes * 2
    views = pipe.kv_caches.views
    assert views[sliding[0]][0].data_ptr() == views[full[0]][0].data_ptr()
    assert views[sliding[1]][0].data_ptr() == views[full[1]][0].data_ptr() != views[full[0]][0].data_ptr()
    uniform = Pipeline(model, attention_backend="torch", block_size=4, num_blocks=40, kv_cache_groups="uniform")
    assert type(uniform.kv_cache_manager) is KVCacheManager and type(uniform.runner).__name__ == "ModelRunner"


@pytest.mark.parametrize("setting", [
    dict(),
    dict(enable_prefix_caching=True, block_size=4, num_blocks=16, max_num_batched_tokens=16),
    dict(enable_prefix_caching=False, block_size=2, num_blocks=24, max_num_batched_tokens=7, max_num_seqs=3),
    dict(drafter="ngram", num_speculative_tokens=3, block_size=2, num_blocks=40, max_num_batched_tokens=16),
], ids=["defaults", "caching-preempt", "no-caching-tiny-blocks", "ngram-drafts"])
def test_hybrid_pipeline_is_token_exact(ckpt, setting):
    arch, model, config, hf = ckpt
    prompts = _prompts(config.vocab_size)
    if "drafter" in setting:  # repeated text, so the n-gram drafter proposes (and gets some right)
        prompts = [p * 2 for p in prompts]
    pipe = Pipeline(model, attention_backend="torch", **setting)
    assert pipe.kv_cache_groups is not None
    params = SamplingParams(temperature=0.0, max_tokens=6)
    rids = [pipe.add_request(p, params) for p in prompts]
    outs: dict[str, list[int]] = {}
    while pipe.has_unfinished_requests():
        for event in pipe.step():
            outs.setdefault(event.request_id, []).extend(event.new_token_ids)
        _check_tables(pipe)
    for rid, prompt in zip(rids, prompts):
        assert outs[rid] == _hf_greedy(hf, prompt, 6)
    manager = pipe.kv_cache_manager
    assert manager.num_free_blocks == pipe.num_blocks - 1 and not manager.req_to_blocks
    if "num_blocks" in setting and "drafter" not in setting:
        assert pipe.scheduler.num_preemptions > 0
    if setting.get("enable_prefix_caching"):
        assert manager.prefix_cache_stats.hit_tokens > 0
        again = pipe.generate(prompts[:1], params)[0]  # served from the cache (both groups)
        assert list(again.token_ids) == _hf_greedy(hf, prompts[0], 6)
        assert manager.num_free_blocks == pipe.num_blocks - 1


def test_sliding_group_releases_blocks_while_running(ckpt):
    arch, model, config, hf = ckpt
    prompt = random_prompts([30], config.vocab_size, seed=7)[0]
    pipe = Pipeline(model, attention_backend="torch", block_size=2, num_blocks=80, max_num_batched_tokens=8)
    rid = pipe.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8))
    manager, tokens, held = pipe.kv_cache_manager, [], []
    kinds = [type(g.spec) for g in manager.groups]
    while pipe.has_unfinished_requests():
        for event in pipe.step():
            tokens += event.new_token_ids
        if rid in manager.req_to_blocks:
            ids = manager.get_block_ids(rid)
            held.append({k: sum(b != 0 for b in ids[g]) for g, k in enumerate(kinds)})
    assert tokens == _hf_greedy(hf, prompt, 8)
    last = held[-1]
    # The window (6 tokens, 2-token blocks) needs at most 4 blocks; full attention all 19.
    assert last[SlidingWindowSpec] <= 4 < last[FullAttentionSpec]
    assert manager.num_free_blocks == pipe.num_blocks - 1


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_hybrid_pipeline_other_backends(ckpt, backend):
    arch, model, config, hf = ckpt
    small = backend == "triton"  # the interpreter is slow: fewer, shorter requests
    prompts = _prompts(config.vocab_size, lengths=(3,))[:1] + [random_prompts([10], config.vocab_size, seed=9)[0]] \
        if small else _prompts(config.vocab_size)
    new = 3 if small else 6
    setting = dict(enable_prefix_caching=True, block_size=4, num_blocks=12 if small else 16,
                   max_num_batched_tokens=16)
    try:
        if arch == "gemma2" and backend == "sdpa":  # refused when the pipeline is built, with the reason
            with pytest.raises(ValueError, match="'sdpa' cannot run this model: .*softcap"):
                Pipeline(model, attention_backend=backend, **setting)
            return
        pipe = Pipeline(model, attention_backend=backend, **setting)
        assert pipe.attention_backend == backend
        outs = pipe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new))
    finally:
        model.attention = "torch"
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == _hf_greedy(hf, prompt, new), out
    assert pipe.kv_cache_manager.num_free_blocks == pipe.num_blocks - 1


@pytest.mark.parametrize("backend", ["torch", "sdpa", "triton"])
def test_released_blocks_in_stale_rows_never_reach_results(ckpt, backend):
    """The runner keeps released (out-of-window) block ids in a sliding group's
    row and the buffer is not zero-filled: with every block but the null one
    full of NaN, reused blocks read under the window mask must not leak NaN."""
    arch, model, config, hf = ckpt
    if arch == "gemma2" and backend == "sdpa":
        pytest.skip("sdpa cannot express Gemma 2's soft-capping (refusal tested above)")
    prompts = _prompts(config.vocab_size)[:3 if backend == "triton" else 4]
    new = 3 if backend == "triton" else 6
    try:
        pipe = Pipeline(model, attention_backend=backend, block_size=2, num_blocks=20, max_num_batched_tokens=7,
                        max_num_seqs=3, enable_prefix_caching=False)
        for layer in pipe.kv_caches.views:
            for view in layer:
                view[1:] = float("nan")  # block 0 (null) stays zero, as allocate_kv_cache leaves it
        outs = pipe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new))
    finally:
        model.attention = "torch"
    assert pipe.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == _hf_greedy(hf, prompt, new), out


_POISON = (float("nan"), float("inf"), float("-inf"))


def _poison(pipe, block_ids):
    """Write NaN, +inf and -inf (cycling over slots) into every layer's page of each block."""
    for layer in pipe.kv_caches.views:
        for view in layer:
            for b in block_ids:
                for slot in range(view.shape[1]):
                    view[b, slot] = _POISON[slot % 3]


def _held(manager, rid) -> set[int]:
    ids = manager.get_block_ids(rid)
    return {i for row in ids for i in (row if isinstance(row, list) else [row])} - {0}


def _run_poisoned(pipe, prompt_a, prompt_b, new):
    """Run A; from step 1 on, B (a long chunked prefill) runs too; after every
    step the blocks A released that B now owns are filled with NaN / +-inf.
    Returns A's tokens and the poisoned block ids."""
    manager = pipe.kv_cache_manager
    a = pipe.add_request(prompt_a, SamplingParams(temperature=0.0, max_tokens=new))
    tokens, released, poisoned, held_before = [], set(), set(), set()
    for step in range(30):
        if step == 1:  # B arrives while A runs (A prefills in chunks of 5, then decodes)
            b = pipe.add_request(prompt_b, SamplingParams(temperature=0.0, max_tokens=1))
        for event in pipe.step():
            if event.request_id == a:
                tokens += event.new_token_ids
        if a not in manager.req_to_blocks:
            break
        if isinstance(manager, HybridKVCacheManager):
            _check_tables(pipe)
        held_a = _held(manager, a)
        released |= held_before - held_a
        held_before = held_a
        reowned = _held(manager, b) & released if step >= 1 else set()
        _poison(pipe, reowned)
        poisoned |= reowned
    pipe.abort_request(b)
    return tokens, poisoned


@pytest.mark.parametrize("backend", ["torch", "sdpa", "triton"])
def test_released_block_reowned_and_poisoned_never_reaches_the_releaser(ckpt, backend):
    """Request A's sliding window releases blocks while A decodes; request B
    (a long chunked prefill) is handed them, and they are filled with NaN and
    +-inf after every step (as if B's KV overflowed). A's table must name the
    null block there, not B's block: A stays token-exact and its rows equal
    the manager's (null included)."""
    arch, model, config, hf = ckpt
    if arch == "gemma2" and backend == "sdpa":
        pytest.skip("sdpa cannot express Gemma 2's soft-capping (refusal tested above)")
    prompt_a = random_prompts([16], config.vocab_size, seed=11)[0]
    prompt_b = random_prompts([60], config.vocab_size, seed=12)[0]
    new = 4 if backend == "triton" else 6
    try:
        pipe = Pipeline(model, attention_backend=backend, block_size=2, num_blocks=24, max_num_batched_tokens=5,
                        enable_prefix_caching=False)
        tokens, poisoned = _run_poisoned(pipe, prompt_a, prompt_b, new)
    finally:
        model.attention = "torch"
    assert poisoned, "no block A released was re-owned by B: the test did not test anything"
    assert tokens == _hf_greedy(hf, prompt_a, new)
    assert pipe.kv_cache_manager.num_free_blocks == pipe.num_blocks - 1


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_single_sliding_group_nulls_released_blocks_too(tmp_path, backend):
    """The same on a model whose every layer slides (Mistral): one group, the
    plain KVCacheManager and ModelRunner."""
    path = build_tiny_model(tmp_path / "mistral", arch="mistral", sliding_window=WINDOW, vocab_size=512)
    model, config = load_model(path)
    prompt_a = random_prompts([16], config.vocab_size, seed=11)[0]
    prompt_b = random_prompts([60], config.vocab_size, seed=12)[0]
    pipe = Pipeline(model, attention_backend=backend, block_size=2, num_blocks=13, max_num_batched_tokens=5,
                    enable_prefix_caching=False)
    assert type(pipe.kv_cache_manager) is KVCacheManager and pipe.runner.sliding_window == WINDOW
    tokens, poisoned = _run_poisoned(pipe, prompt_a, prompt_b, 6)
    assert poisoned, "no block A released was re-owned by B: the test did not test anything"
    assert tokens == _hf_greedy(load_hf(path), prompt_a, 6)


def test_given_hybrid_manager_is_checked(ckpt):
    arch, model, config, _ = ckpt
    spec = FullAttentionSpec(block_size=4, num_kv_heads=config.num_key_value_heads, head_size=config.head_dim,
                             dtype=torch.float32)
    window = SlidingWindowSpec(block_size=4, num_kv_heads=config.num_key_value_heads, head_size=config.head_dim,
                               dtype=torch.float32, sliding_window=WINDOW)
    missing = HybridKVCacheManager([KVCacheGroup(spec, (0, 1)), KVCacheGroup(window, (2,))], 20)
    with pytest.raises(ValueError, match=r"layers \[3\] without a group"):
        Pipeline(model, attention_backend="torch", kv_cache_manager=missing)
    wrong = HybridKVCacheManager([KVCacheGroup(window, (0, 1)), KVCacheGroup(spec, (2, 3))], 20)
    # Layer 1 (both models) attends to everything: a window group would drop blocks it reads.
    with pytest.raises(ValueError, match="layer [01] attends to every token"):
        Pipeline(model, attention_backend="torch", kv_cache_manager=wrong)
    from servelab.blocks import make_kv_cache_groups
    from servelab.pipeline.hybrid import layer_kv_cache_specs

    given = HybridKVCacheManager(make_kv_cache_groups(layer_kv_cache_specs(model, 4, torch.float32)), 20)
    pipe = Pipeline(model, attention_backend="torch", kv_cache_manager=given)
    prompt = _prompts(config.vocab_size)[0]
    assert list(pipe.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids) == \
        _hf_greedy(ckpt[3], prompt, 4)
    # One group of every layer (full attention) through the group path: the same tokens.
    single = HybridKVCacheManager([KVCacheGroup(spec, tuple(range(config.num_hidden_layers)))], 20)
    pipe = Pipeline(model, attention_backend="torch", kv_cache_manager=single)
    assert isinstance(pipe.runner, HybridModelRunner)
    assert list(pipe.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids) == \
        _hf_greedy(ckpt[3], prompt, 4)
    bare = HybridKVCacheManager([spec, window], 20)  # bare specs: no layer_indices
    with pytest.raises(ValueError, match="without a group"):
        Pipeline(model, attention_backend="torch", kv_cache_manager=bare)


@pytest.fixture(scope="module")
def gemma2_window8(tmp_path_factory):
    """Gemma 2 with an 8-token window (issue case: 4-token blocks, 19 usable blocks)."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    path = tmp_path_factory.mktemp("gemma2w8")
    hf_config = Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, num_hidden_layers=4,
                             sliding_window=8, query_pre_attn_scalar=12, bos_token_id=1, eos_token_id=2,
                             pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(path)
    model, config = load_model(path)
    return model, config, load_hf(path)


def test_admits_what_chunked_prefill_can_serve(gemma2_window8):
    """A 40-token prompt needs 10 full-attention blocks, and its sliding group
    only the window plus one chunk: with 19 usable blocks it runs (in chunks
    the pool can hold, token-exact), although one 40-token step would need 20.
    A prompt whose full-attention blocks alone exceed the pool is refused
    with the usual message; so is everything with chunked prefill off."""
    model, config, hf = gemma2_window8
    prompt = random_prompts([40], config.vocab_size, seed=21)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    pipe = Pipeline(model, attention_backend="torch", block_size=4, num_blocks=20, max_num_batched_tokens=512)
    assert blocks_needed_alone(pipe.kv_cache_manager.specs, 40, 40) == 20 > 19
    out = pipe.generate([prompt], params)[0]
    assert out.finish_reason == "length" and list(out.token_ids) == _hf_greedy(hf, prompt, 4)
    assert pipe.kv_cache_manager.num_free_blocks == 19
    too_long = random_prompts([77], config.vocab_size, seed=22)[0]  # 20 full-attention blocks alone
    failed = pipe.generate([too_long], params)[0]
    assert failed.finish_reason == "error" and "cannot fit in the KV cache even alone" in failed.error
    assert "19 usable blocks" in failed.error
    whole = Pipeline(model, attention_backend="torch", block_size=4, num_blocks=20, max_num_batched_tokens=512,
                     enable_chunked_prefill=False)
    assert whole.generate([prompt], params)[0].finish_reason == "error"
