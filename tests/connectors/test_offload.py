"""The ``offload`` connector: greedy outputs token for token equal to a pipeline without it,
with the tier really serving hits (a test that hits nothing proves nothing), on the tiny
Llama (async / sync loads, save evicted / all, a disk tier, preemption, speculative
decoding), a hybrid Gemma 2 (sliding-window + full groups) and the real SmolLM2; a
failing load recomputes, a failing save only loses that copy."""

from __future__ import annotations

import os

import pytest
from connector_helpers import one_by_one, shared_prefix_prompts

from servelab import Pipeline, SamplingParams
from servelab.connectors.offload import OffloadConnector

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# 4 prefixes of 6 blocks each and a 19-block pool: the prefixes evict each other.
SMALL = dict(block_size=4, num_blocks=20, enable_prefix_caching=True, attention_backend="torch", max_num_seqs=2)


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(12)


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    model, tok = tiny_llama
    return one_by_one(Pipeline(model, tok, **SMALL), prompts, GREEDY)


def _idle(pipe):
    assert pipe.kv_cache_manager.num_free_blocks == pipe.num_blocks - 1
    assert not pipe.scheduler.has_pending_kv_transfers()


@pytest.mark.parametrize("async_load,save", [(True, "evicted"), (False, "evicted"), (True, "all")])
def test_token_exact_and_hits(tiny_llama, prompts, reference, async_load, save):
    model, tok = tiny_llama
    conn = OffloadConnector(cpu_blocks=64, async_load=async_load, save=save)
    pipe = Pipeline(model, tok, kv_connector=conn, **SMALL)
    assert one_by_one(pipe, prompts, GREEDY) == reference
    stats = conn.stats()
    assert stats["host"]["hits"] > 0 and stats["hit_tokens"] > 0 and stats["failed_loads"] == 0
    assert pipe.scheduler.num_external_hit_tokens == stats["hit_tokens"]
    _idle(pipe)
    conn.shutdown()


def test_disk_tier_serves_what_the_host_tier_dropped(tiny_llama, prompts, reference, tmp_path):
    model, tok = tiny_llama
    conn = OffloadConnector(cpu_blocks=3, disk_dir=tmp_path, disk_blocks=64)
    pipe = Pipeline(model, tok, kv_connector=conn, **SMALL)
    assert one_by_one(pipe, prompts, GREEDY) == reference
    stats = conn.stats()
    assert stats["host"]["evicted"] > 0 and stats["disk"]["hits"] > 0
    _idle(pipe)
    conn.shutdown()


def test_batch_with_preemption_and_speculation(tiny_llama, prompts):
    model, tok = tiny_llama
    kw = dict(SMALL, max_num_seqs=4, drafter="ngram", num_speculative_tokens=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)  # long enough to preempt
    want = [o.token_ids for o in Pipeline(model, tok, **kw).generate(prompts, params)]
    conn = OffloadConnector(cpu_blocks=64)
    pipe = Pipeline(model, tok, kv_connector=conn, **kw)
    got = [o.token_ids for o in pipe.generate(prompts, params)]
    got += [o.token_ids for o in pipe.generate(prompts, params)]  # a second pass: prefixes come from the tier
    assert got == want + want
    assert pipe.scheduler.num_preemptions > 0 and conn.stats()["host"]["hits"] > 0
    _idle(pipe)
    conn.shutdown()


def test_failed_load_recomputes(tiny_llama, prompts, reference):
    model, tok = tiny_llama
    conn = OffloadConnector(cpu_blocks=64)
    real_read, calls = conn._read, []

    def flaky_read(key):  # every third block read fails (the loader's view: the block is gone)
        calls.append(key)
        return None if len(calls) % 3 == 0 else real_read(key)

    conn._read = flaky_read
    pipe = Pipeline(model, tok, kv_connector=conn, **SMALL)
    assert one_by_one(pipe, prompts, GREEDY) == reference
    assert conn.stats()["failed_loads"] > 0 and pipe.scheduler.num_failed_loads == conn.stats()["failed_loads"]
    _idle(pipe)
    conn.shutdown()


@pytest.mark.parametrize("async_load", [True, False])
def test_corrupt_load_would_be_caught(tiny_llama, prompts, reference, async_load):
    """The oracle can fail: a connector that loads wrong KV changes the outputs."""
    import torch

    model, tok = tiny_llama
    conn = OffloadConnector(cpu_blocks=64, async_load=async_load)
    real_read = conn._read
    conn._read = lambda key: [torch.randn_like(t) for t in real_read(key)]
    pipe = Pipeline(model, tok, kv_connector=conn, **SMALL)
    assert one_by_one(pipe, prompts, GREEDY) != reference
    conn.shutdown()


def test_failed_save_loses_only_the_copy(tiny_llama, prompts, reference):
    model, tok = tiny_llama
    conn = OffloadConnector(cpu_blocks=64)
    real_save, calls = conn._save, []

    def flaky_save(key, payload):
        calls.append(key)
        if len(calls) % 2:
            raise OSError("disk full")
        real_save(key, payload)

    conn._save = flaky_save
    pipe = Pipeline(model, tok, kv_connector=conn, **SMALL)
    assert one_by_one(pipe, prompts, GREEDY) == reference
    assert conn.stats()["failed_saves"] > 0 and conn.stats()["host"]["hits"] > 0
    _idle(pipe)
    conn.shutdown()


def test_hybrid_gemma2_token_exact(tiny_gemma2):
    model = tiny_gemma2
    prompts = shared_prefix_prompts(10, prefix_len=16, vocab=90, seed=1)
    kw = dict(block_size=4, num_blocks=24, enable_prefix_caching=True, max_num_seqs=2)
    base = Pipeline(model, **kw)
    assert base.kv_cache_groups is not None and len(base.kv_cache_groups) > 1  # really hybrid
    want = one_by_one(base, prompts, GREEDY)
    conn = OffloadConnector(cpu_blocks=128)
    pipe = Pipeline(model, kv_connector=conn, **kw)
    assert one_by_one(pipe, prompts, GREEDY) == want
    assert conn.stats()["host"]["hits"] > 0
    _idle(pipe)
    conn.shutdown()


@pytest.mark.skipif(os.environ.get("SERVELAB_FETCH_REAL_CHECKPOINT") != "1",
                    reason="set SERVELAB_FETCH_REAL_CHECKPOINT=1 for the real SmolLM2 checkpoint")
def test_smollm2_token_exact():
    from servelab.models import hub

    pipes = {}
    path = hub.fetch_smollm2()
    prompts = shared_prefix_prompts(6, num_prefixes=3, prefix_len=64, vocab=40000, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(block_size=16, num_blocks=8, enable_prefix_caching=True, max_num_seqs=1)  # one prefix at a time
    pipes["none"] = Pipeline.from_pretrained(path, **kw)
    conn = OffloadConnector(cpu_blocks=64)
    pipes["offload"] = Pipeline(pipes["none"].model, pipes["none"].tokenizer, kv_connector=conn, **kw)
    want = one_by_one(pipes["none"], prompts, params)
    assert one_by_one(pipes["offload"], prompts, params) == want
    assert conn.stats()["host"]["hits"] > 0
    _idle(pipes["offload"])
    conn.shutdown()
