"""Sliding-window groups move only their window's blocks (:mod:`servelab.connectors.windows`):
the ``offload`` connector stores fewer blocks for the tiny Gemma 2's sliding groups than for
its full groups, and ``pd`` hands over per-group KV, window blocks only for sliding groups;
greedy outputs stay token for token those of a pipeline without a connector, with hits
really served from the tier / the transfer."""

from __future__ import annotations

import os
import random

import pytest
import torch
from connector_helpers import one_by_one

from servelab import Pipeline, SamplingParams
from servelab.blocks.specs import SlidingWindowSpec
from servelab.connectors.channels import DirectoryChannel, InProcessChannel
from servelab.connectors.offload import OffloadConnector
from servelab.connectors.pd import PDConnector, disaggregated_generate
from servelab.connectors.windows import GroupView, longest_servable

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
KW = dict(block_size=4, num_blocks=40, enable_prefix_caching=True, max_num_seqs=2)


@pytest.fixture(scope="module")
def conversations(tiny_gemma2):
    """Three 3-turn conversations (each turn: the previous prompt, its greedy answer and 3
    new tokens) interleaved, then every first prompt again: hits at the save points."""
    base = Pipeline(tiny_gemma2, **KW)
    rng = random.Random(3)
    turns = [[[1] + [rng.randrange(3, 90) for _ in range(29 + c)]] for c in range(3)]
    with torch.inference_mode():
        for _ in range(2):
            for conv in turns:
                out = base.generate([conv[-1]], GREEDY)[0]
                conv.append(conv[-1] + list(out.token_ids) + [rng.randrange(3, 90) for _ in range(3)])
    prompts = [conv[k] for k in range(3) for conv in turns]
    return prompts + [conv[0] for conv in turns]


def _idle(pipe):
    assert pipe.kv_cache_manager.num_free_blocks == pipe.num_blocks - 1, "leaked blocks"
    assert not pipe.scheduler.has_pending_kv_transfers()


def _sliding(pipe):
    return [g for g, group in enumerate(pipe.kv_cache_manager.groups) if isinstance(group.spec, SlidingWindowSpec)]


def test_group_view_needs_the_window_only():
    full, sliding = GroupView(4), GroupView(4, window_blocks=2)  # window 6: ceil(5 / 4) = 2 blocks
    assert full.needed(8, 24) == range(2, 6) and sliding.needed(8, 24) == range(4, 6)
    assert sliding.needed(20, 24) == range(5, 6) and sliding.needed(0, 4) == range(0, 1)
    hashes = [[b"f%d" % i for i in range(8)], [b"s%d" % i for i in range(8)]]
    store = {*hashes[0][:7], b"s1", b"s2", b"s4", b"s5"}
    # full serves up to 28 tokens; the sliding window is there for 24 (blocks 4, 5) and 12 (1, 2)
    assert longest_servable([full, sliding], hashes, store.__contains__, 0, 31, 4) == 24
    store.discard(b"s5")
    assert longest_servable([full, sliding], hashes, store.__contains__, 0, 31, 4) == 12
    assert longest_servable([full, sliding], hashes, store.__contains__, 12, 31, 4) == 12  # nothing past 12


@pytest.mark.parametrize("save,async_load", [("all", True), ("evicted", True), ("all", False)])
def test_offload_stores_only_the_window_of_sliding_groups(tiny_gemma2, conversations, save, async_load):
    want = one_by_one(Pipeline(tiny_gemma2, **KW), conversations, GREEDY)
    conn = OffloadConnector(cpu_blocks=256, save=save, async_load=async_load)
    pipe = Pipeline(tiny_gemma2, kv_connector=conn, **KW)
    assert one_by_one(pipe, conversations, GREEDY) == want
    stats = conn.stats()
    sliding = _sliding(pipe)
    full = [g for g in range(len(conn._views)) if g not in sliding]
    assert sliding and full
    stored = stats["group_stored_blocks"]
    assert max(stored[g] for g in sliding) < min(stored[g] for g in full), stats
    assert max(stats["group_stored_bytes"][g] for g in sliding) < min(stats["group_stored_bytes"][g] for g in full)
    # hits came from the tier, for every group (sliding ones: their window blocks)
    assert stats["failed_loads"] == 0 and pipe.scheduler.num_external_hit_tokens > 0
    assert all(stats["group_loaded_blocks"][g] > 0 for g in range(len(conn._views))), stats
    _idle(pipe)
    conn.shutdown()


@pytest.mark.parametrize("async_load", [True, False])
def test_unloaded_sliding_blocks_are_never_committed(tiny_gemma2, async_load):
    """A load of 40 tokens fills only blocks 8, 9 of a sliding group; its blocks 0..7 hold
    noise and must not become findable: a later 13-token prefix of the same prompt would
    read them as a local hit (blocks 1, 2) and answer wrongly."""
    rng = random.Random(7)
    prompt = [1] + [rng.randrange(3, 90) for _ in range(40)]
    other = [1] + [rng.randrange(3, 90) for _ in range(5)]
    base = Pipeline(tiny_gemma2, **KW)
    want = one_by_one(base, [prompt, prompt[:13]], GREEDY)
    conn = OffloadConnector(cpu_blocks=256, save="all", async_load=async_load)
    pipe = Pipeline(tiny_gemma2, kv_connector=conn, **KW)
    assert one_by_one(pipe, [prompt, other], GREEDY)[0] == want[0]  # `other`'s step copied prompt's blocks out
    assert pipe.kv_cache_manager.reset_prefix_cache()
    with torch.no_grad():
        for layer in pipe.kv_caches.views:  # every page not loaded from the tier is noise now
            for t in layer:
                t.normal_()
    assert one_by_one(pipe, [prompt, prompt[:13]], GREEDY) == want
    assert pipe.scheduler.num_external_hit_tokens == 40
    _idle(pipe)
    conn.shutdown()


@pytest.mark.parametrize("kind", ["in_process", "directory"])
def test_pd_hands_over_per_group_kv(tiny_gemma2, kind, tmp_path):
    """Prefill on one Gemma 2 pipeline, decode on another: each transfer carries every block of
    the full groups and only the window (2 blocks) of the sliding groups."""
    rng = random.Random(11)
    prompts = [[1] + [rng.randrange(3, 90) for _ in range(n)] for n in (17, 22, 30, 35, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = one_by_one(Pipeline(tiny_gemma2, **KW), prompts, params)
    channel = InProcessChannel() if kind == "in_process" else DirectoryChannel(tmp_path)
    prefill = Pipeline(tiny_gemma2, kv_connector=PDConnector("producer", channel), **KW)
    decode = Pipeline(tiny_gemma2, kv_connector=PDConnector("consumer", channel), **KW)
    with torch.inference_mode():
        outs = disaggregated_generate(prefill, decode, prompts, params)
    assert [tuple(o.token_ids) for o in outs] == want
    producer = prefill.kv_connector
    assert decode.kv_connector.num_received == len(prompts) and decode.kv_connector.num_failed_loads == 0
    # every decode request computed only its tail: the prompt's aligned blocks came from the transfer
    assert decode.scheduler.num_external_hit_tokens == sum(len(p) // 4 * 4 for p in prompts)
    sent = producer.group_sent_blocks
    sliding = _sliding(prefill)
    full = [g for g in range(len(sent)) if g not in sliding]
    assert all(sent[g] == sum(len(p) // 4 for p in prompts) for g in full), sent
    assert all(sent[g] == 2 * len(prompts) for g in sliding), sent
    assert channel.bytes_pulled == producer.bytes_published
    _idle(prefill)
    _idle(decode)
    if kind == "directory":
        assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.environ.get("SERVELAB_FETCH_REAL_CHECKPOINT") != "1",
                    reason="set SERVELAB_FETCH_REAL_CHECKPOINT=1 for the real Gemma 3 270M checkpoint")
def test_pd_gemma3_token_exact():
    """Gemma 3 270M (five sliding groups of window 512, one full): a 600-token prompt's handoff
    carries 32 window blocks per sliding group, 37 for the full one; greedy, token for token."""
    from servelab.models import hub

    kw = dict(block_size=16, num_blocks=300, enable_prefix_caching=True)
    base = Pipeline.from_pretrained(hub.fetch_gemma3_270m(), **kw)
    rng = random.Random(0)
    prompt = [2] + [rng.randrange(100, 20000) for _ in range(599)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with torch.inference_mode():
        want = tuple(base.generate([prompt], params)[0].token_ids)
        channel = InProcessChannel()
        prefill = Pipeline(base.model, base.tokenizer, kv_connector=PDConnector("producer", channel), **kw)
        decode = Pipeline(base.model, base.tokenizer, kv_connector=PDConnector("consumer", channel), **kw)
        out = disaggregated_generate(prefill, decode, [prompt], params)[0]
    assert tuple(out.token_ids) == want and decode.scheduler.num_external_hit_tokens == 592
    assert decode.kv_connector.num_received == 1 and decode.kv_connector.num_failed_loads == 0
    sent = prefill.kv_connector.group_sent_blocks
    assert sorted(sent) == [32] * (len(sent) - 1) + [37], sent
    _idle(prefill)
    _idle(decode)
