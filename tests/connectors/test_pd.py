"""The ``pd`` connector: prefill on one pipeline, decode on another, token for token equal
to one pipeline (greedy), in one process and through a directory (also from another
process); leases: the producer frees on confirmation or expiry, a transfer gone before
the pull makes the consumer recompute, a consumer that never comes costs only the lease."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from connector_helpers import shared_prefix_prompts

from servelab import Pipeline, SamplingParams
from servelab.connectors.channels import DirectoryChannel, InProcessChannel
from servelab.connectors.pd import PDConnector, disaggregated_generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
KW = dict(block_size=4, num_blocks=48, enable_prefix_caching=True, attention_backend="torch")


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(6, num_prefixes=6, prefix_len=13, seed=5)


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    model, tok = tiny_llama
    return [tuple(o.token_ids) for o in Pipeline(model, tok, **KW).generate(prompts, GREEDY)]


def _pair(tiny_llama, channel, lease_s=30.0, **kw):
    model, tok = tiny_llama
    settings = dict(KW, **kw)
    return (Pipeline(model, tok, kv_connector=PDConnector("producer", channel, lease_s=lease_s), **settings),
            Pipeline(model, tok, kv_connector=PDConnector("consumer", channel), **settings))


def _idle(pipe):
    assert pipe.kv_cache_manager.num_free_blocks == pipe.num_blocks - 1, "leaked blocks"
    assert not pipe.scheduler.has_pending_kv_transfers() and not pipe.has_unfinished_requests()


def test_in_process_token_exact(tiny_llama, prompts, reference):
    channel = InProcessChannel()
    prefill, decode = _pair(tiny_llama, channel)
    outs = disaggregated_generate(prefill, decode, prompts, GREEDY)
    assert [tuple(o.token_ids) for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert decode.kv_connector.num_received == len(prompts) and channel.bytes_pulled > 0
    # Each decode request computed only its tail: the transferred blocks were hits.
    assert decode.scheduler.num_external_hit_tokens == sum(len(p) // 4 * 4 for p in prompts)
    _idle(prefill)
    _idle(decode)


def test_producer_preempted_during_prefill_recomputes(tiny_llama, prompts, reference):
    """Prefills in an 8-block pool preempt each other before they end (nothing was published
    for them then); what ends is handed over, and its held blocks come back once pulled."""
    model, tok = tiny_llama
    channel = InProcessChannel()
    prefill = Pipeline(model, tok, kv_connector=PDConnector("producer", channel),
                       **dict(KW, num_blocks=8, max_num_batched_tokens=8))
    decode = Pipeline(model, tok, kv_connector=PDConnector("consumer", channel), **KW)
    outs = disaggregated_generate(prefill, decode, prompts, GREEDY)
    assert [tuple(o.token_ids) for o in outs] == reference
    assert prefill.scheduler.num_preemptions > 0 and decode.kv_connector.num_received > 0
    _idle(decode)
    while prefill.scheduler.has_pending_kv_transfers():
        prefill.step()
    _idle(prefill)


def test_directory_channel_token_exact(tiny_llama, prompts, reference, tmp_path):
    channel = DirectoryChannel(tmp_path)
    prefill, decode = _pair(tiny_llama, channel)
    outs = disaggregated_generate(prefill, decode, prompts, GREEDY)
    assert [tuple(o.token_ids) for o in outs] == reference and channel.bytes_pulled > 0
    _idle(prefill)
    _idle(decode)
    assert list(tmp_path.iterdir()) == []  # settled transfers are deleted


def test_lease_expired_before_the_pull_recomputes(tiny_llama, prompts, reference):
    clock = FakeClock()
    channel = InProcessChannel(clock=clock)
    prefill, decode = _pair(tiny_llama, channel, lease_s=5.0)
    firsts = prefill.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    handoffs = [prefill.kv_connector.transfer_params(o.request_id) for o in firsts]
    assert prefill.kv_cache_manager.num_free_blocks < prefill.num_blocks - 1  # held for the consumer
    prefill.step()
    assert prefill.scheduler.has_pending_kv_transfers()  # not confirmed, not expired: still held
    clock.now += 6.0
    prefill.step()  # the lease expired: revoked and freed
    _idle(prefill)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, extra_args={"kv_transfer_params": h})
              for h in handoffs]
    outs = decode.generate([h["token_ids"] for h in handoffs], params)
    assert [tuple(f.token_ids) + tuple(o.token_ids) for f, o in zip(firsts, outs)] == reference[:2]
    assert decode.scheduler.num_external_hit_tokens == 0  # nothing was offered: computed locally
    _idle(decode)


def test_lease_expired_during_the_pull_recomputes(tiny_llama, prompts, reference):
    clock = FakeClock()

    class ExpiringChannel(InProcessChannel):
        def pull(self, transfer_id, indices, writer):
            clock.now += 60.0  # the lease runs out just as the pull starts
            return super().pull(transfer_id, indices, writer)

    channel = ExpiringChannel(clock=clock)
    prefill, decode = _pair(tiny_llama, channel, lease_s=5.0)
    outs = disaggregated_generate(prefill, decode, prompts, GREEDY)
    assert [tuple(o.token_ids) for o in outs] == reference
    assert decode.kv_connector.num_failed_loads == len(prompts) and decode.scheduler.num_failed_loads == len(prompts)
    _idle(decode)
    prefill.step()
    _idle(prefill)


def test_consumer_never_comes(tiny_llama, prompts):
    clock = FakeClock()
    channel = InProcessChannel(clock=clock)
    prefill, _ = _pair(tiny_llama, channel, lease_s=2.0)
    prefill.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    for _ in range(3):
        prefill.step()
    assert prefill.scheduler.has_pending_kv_transfers()  # prefer leaking to misusing, while the lease holds
    clock.now += 3.0
    prefill.step()
    _idle(prefill)


def test_other_tokens_kv_is_never_used(tiny_llama, prompts, reference):
    """A consumer request handed another prompt's transfer gets no external hit."""
    channel = InProcessChannel()
    prefill, decode = _pair(tiny_llama, channel)
    first = prefill.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0]
    handoff = prefill.kv_connector.transfer_params(first.request_id)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, extra_args={"kv_transfer_params": handoff})
    out = decode.generate([prompts[1]], params)[0]
    assert tuple(out.token_ids) == reference[1] and decode.scheduler.num_external_hit_tokens == 0
    prefill.step()  # the consumer's request ended without pulling: it released the transfer
    _idle(prefill)


def test_across_two_processes(tiny_llama, prompts, reference, tmp_path):
    """The producer runs in another process (same checkpoint) and exits; the consumer reads the folder."""
    model, tok = tiny_llama
    ckpt = tmp_path / "ckpt"
    from servelab.models import build_tiny_model

    build_tiny_model(ckpt, arch="llama", seed=0)  # the same weights as the fixture's
    script = textwrap.dedent(f"""
        import json, torch
        torch.set_num_threads(1)
        from servelab import Pipeline, SamplingParams
        from servelab.connectors.channels import DirectoryChannel
        from servelab.connectors.pd import PDConnector
        pipe = Pipeline.from_pretrained({str(ckpt)!r}, kv_connector=PDConnector("producer",
                                        DirectoryChannel({str(tmp_path / "xfer")!r}), lease_s=600), **{KW!r})
        outs = pipe.generate({prompts!r}, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        print(json.dumps([[o.token_ids, pipe.kv_connector.transfer_params(o.request_id)] for o in outs]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    handed = json.loads(done.stdout.strip().splitlines()[-1])
    decode = Pipeline(model, tok, kv_connector=PDConnector("consumer", DirectoryChannel(tmp_path / "xfer")), **KW)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, extra_args={"kv_transfer_params": h})
              for _, h in handed]
    outs = decode.generate([h["token_ids"] for _, h in handed], params)
    assert [tuple(f) + tuple(o.token_ids) for (f, _), o in zip(handed, outs)] == reference
    assert decode.kv_connector.num_received == len(prompts)
    _idle(decode)


def test_refuses_what_it_cannot_do(tiny_llama, tiny_gemma2):
    with pytest.raises(ValueError, match="role='both'"):
        PDConnector("both", InProcessChannel())
    with pytest.raises(TypeError, match="TransferChannel"):
        PDConnector("producer", object())
    with pytest.raises(ValueError, match="publish_at='start'"):
        PDConnector("producer", InProcessChannel(), publish_at="start")
    model, tok = tiny_llama
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        Pipeline(model, tok, block_size=4, num_blocks=24, enable_prefix_caching=False,
                 kv_connector=PDConnector("consumer", InProcessChannel()))


@pytest.mark.skipif(os.environ.get("SERVELAB_FETCH_REAL_CHECKPOINT") != "1",
                    reason="set SERVELAB_FETCH_REAL_CHECKPOINT=1 for the real SmolLM2 checkpoint")
def test_smollm2_token_exact():
    """Prefill and decode of the real SmolLM2 on two pipelines, greedy: token for token one pipeline's."""
    from servelab.models import hub

    path = hub.fetch_smollm2()
    prompts = shared_prefix_prompts(4, num_prefixes=2, prefix_len=40, vocab=40000, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(block_size=16, num_blocks=32, enable_prefix_caching=True)
    base = Pipeline.from_pretrained(path, **kw)
    want = [tuple(o.token_ids) for o in base.generate(prompts, params)]
    channel = InProcessChannel()
    prefill = Pipeline(base.model, base.tokenizer, kv_connector=PDConnector("producer", channel), **kw)
    decode = Pipeline(base.model, base.tokenizer, kv_connector=PDConnector("consumer", channel), **kw)
    outs = disaggregated_generate(prefill, decode, prompts, params)
    assert [tuple(o.token_ids) for o in outs] == want
    assert decode.kv_connector.num_received == len(prompts)
    assert decode.scheduler.num_external_hit_tokens == sum(len(p) // 16 * 16 for p in prompts)
    _idle(prefill)
    _idle(decode)
