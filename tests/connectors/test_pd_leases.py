"""A ``pd`` producer request preempted after it published its KV (``publish_at="prefill"``)
and before the consumer confirmed: the lease holds its own references, so the published
blocks are never reused while a pull may read them; the producer request recomputes; the
consumer gets the complete, hash-checked transfer — or, once the lease expired, recomputes."""

from __future__ import annotations

import pytest
import torch
from connector_helpers import shared_prefix_prompts

from servelab import Pipeline, SamplingParams
from servelab.connectors.channels import InProcessChannel
from servelab.connectors.pd import PDConnector
from servelab.scheduling.policies import FCFSPolicy

GREEDY = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
KW = dict(block_size=4, enable_prefix_caching=True, attention_backend="torch")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class PreemptFirst(FCFSPolicy):
    """Preempts the named request whenever it runs, and admits it last (so the test picks
    the victim, and others take the pool's free blocks before it comes back)."""

    def __init__(self, victim: str):
        super().__init__()
        self.victim = victim

    def key(self, request):
        return (request.request_id == self.victim, super().key(request))

    def select_victim(self, running):
        return next((r for r in running if r.request_id == self.victim), running[-1])


@pytest.fixture(scope="module")
def prompts():
    return (shared_prefix_prompts(2, num_prefixes=2, prefix_len=17, seed=9)
            + shared_prefix_prompts(1, num_prefixes=1, prefix_len=17, seed=10))


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    model, tok = tiny_llama
    return [tuple(o.token_ids) for o in Pipeline(model, tok, num_blocks=48, **KW).generate(prompts, GREEDY)]


def _tensors(producer, blocks):
    return [[t.clone() for t in producer._block_tensors(b.block_id, 0)] for b in blocks]


def _preempted_after_publishing(tiny_llama, prompts, lease_s):
    """Request "a" publishes its prompt, then request "b" needs the pool: "a" is preempted
    (the policy's victim) before any consumer pulled; "c" arrives and is admitted before "a"
    comes back: it would take (and overwrite) the blocks "a" freed, were they free."""
    model, tok = tiny_llama
    clock = Clock()
    channel = InProcessChannel(clock=clock)
    producer = PDConnector("producer", channel, lease_s=lease_s, publish_at="prefill")
    prefill = Pipeline(model, tok, num_blocks=12, max_num_batched_tokens=32, kv_connector=producer,
                       policy=PreemptFirst("a"), **KW)
    prefill.add_request(prompts[0], GREEDY, request_id="a")
    while "a" not in producer._leases:
        prefill.step()
    leased = list(producer._leases["a"])
    before = _tensors(producer, leased)
    prefill.add_request(prompts[1], GREEDY, request_id="b")
    while prefill.scheduler.num_preemptions == 0:
        prefill.step()
    req = prefill.scheduler.requests["a"]
    assert req.num_preemptions == 1 and req.num_computed_tokens == 0  # preempted: recomputes
    assert all(b.ref_cnt >= 1 for b in leased)  # the lease's references keep them
    prefill.add_request(prompts[2], GREEDY, request_id="c")
    return clock, channel, producer, prefill, leased, before


def _consumer(tiny_llama, channel, prompt, first_token):
    model, tok = tiny_llama
    decode = Pipeline(model, tok, num_blocks=48, kv_connector=PDConnector("consumer", channel), **KW)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"transfer_id": "a"}})
    with torch.inference_mode():
        out = decode.generate([list(prompt) + [first_token]], params)[0]
    return decode, tuple(out.token_ids)


def _drain(pipe, clock):
    """Run to the end, time passing: leases no consumer confirms (the producer published "b",
    and "a" again) run out, so requests waiting for their blocks go on."""
    while pipe.has_unfinished_requests() or pipe.scheduler.has_pending_kv_transfers():
        pipe.step()
        clock.now += 1.0
    assert pipe.kv_cache_manager.num_free_blocks == pipe.num_blocks - 1, "leaked blocks"


def test_preempted_producer_keeps_published_blocks_for_the_pull(tiny_llama, prompts, reference):
    clock, channel, producer, prefill, leased, before = _preempted_after_publishing(tiny_llama, prompts, 30.0)
    for _ in range(8):  # "b" runs on, "c" wants room, blocks come and go
        prefill.step()
    assert all(torch.equal(x, y) for bx, by in zip(before, _tensors(producer, leased)) for x, y in zip(bx, by))
    decode, tail = _consumer(tiny_llama, channel, prompts[0], reference[0][0])
    assert tail == reference[0][1:]
    assert decode.scheduler.num_external_hit_tokens == len(prompts[0]) // 4 * 4  # the transfer served it
    _drain(prefill, clock)
    _drain(decode, clock)
    assert [tuple(prefill.get_output(rid, pop=True).token_ids) for rid in ("a", "b", "c")] == reference


def test_lease_expired_while_preempted_consumer_recomputes(tiny_llama, prompts, reference):
    clock, channel, producer, prefill, leased, _ = _preempted_after_publishing(tiny_llama, prompts, 5.0)
    clock.now += 10.0
    prefill.step()  # revoked, the references released
    assert "a" not in producer._leases
    decode, tail = _consumer(tiny_llama, channel, prompts[0], reference[0][0])
    assert tail == reference[0][1:] and decode.scheduler.num_external_hit_tokens == 0
    _drain(prefill, clock)
    _drain(decode, clock)
    assert [tuple(prefill.get_output(rid, pop=True).token_ids) for rid in ("a", "b", "c")] == reference
