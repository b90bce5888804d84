"""``Request`` and ``SchedulerConfig``: validation, counts, incremental hashes, metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from servelab.blocks import FullAttentionSpec, KVCacheManager, KVCacheRequest, TokenSequence
from servelab.samplers.params import SamplingParams
from servelab.scheduling import Request, RequestStatus, Scheduler, SchedulerConfig


def test_request_counts_and_protocol():
    r = Request("a", [5, 6, 7], SamplingParams(max_tokens=3), eos_token_id=2)
    assert isinstance(r, KVCacheRequest)
    assert (r.num_prompt_tokens, r.num_tokens, r.num_output_tokens, r.num_computed_tokens) == (3, 3, 0, 0)
    assert r.status is RequestStatus.WAITING and not r.is_finished and r.finish_reason is None
    r.spec_token_ids = [1, 1]
    assert r.num_tokens_with_spec == 5
    r.append_output_token_ids([9, 10], now=4.0)
    assert r.output_token_ids == [9, 10] and r.num_tokens == 5
    assert r.first_token_time == 4.0 and r.token_times == [4.0, 4.0]
    assert r.stop_token_ids == {2}


def test_block_hashes_grow_incrementally_and_match_hashing_from_scratch():
    r = Request("a", list(range(10)), lora_name="lora-x", cache_salt="salt")
    r.init_block_hasher(4)
    assert len(r.block_hashes) == 2
    r.append_output_token_ids([10, 11])
    assert len(r.block_hashes) == 3
    r.append_output_token_ids([12])
    assert len(r.block_hashes) == 3
    ref = TokenSequence("a", list(range(13)), 4, lora_name="lora-x", cache_salt="salt")
    assert r.block_hashes == ref.block_hashes
    with pytest.raises(ValueError, match="block_size"):
        r.init_block_hasher(8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"request_id": ""}, "request_id"),
        ({"prompt_token_ids": []}, "empty prompt"),
        ({"prompt_token_ids": [1, -1]}, "non-negative"),
        ({"prompt_token_ids": [1, 2.5]}, "non-negative ints"),
        ({"priority": 1.5}, "priority must be an int"),
        ({"eos_token_id": -3}, "eos_token_id=-3 must be >= 0"),
        ({"arrival_time": float("nan")}, "arrival_time=nan must be finite"),
        ({"arrival_time": "now"}, "arrival_time must be a number"),
    ],
)
def test_request_rejects_bad_input(kwargs, match):
    args = {"request_id": "r", "prompt_token_ids": [1, 2]} | kwargs
    with pytest.raises((TypeError, ValueError), match=match):
        Request(args.pop("request_id"), args.pop("prompt_token_ids"), **args)


def test_request_metrics():
    r = Request("a", [1, 2], arrival_time=1.0)
    r.first_scheduled_time = 1.5
    for t in (2.0, 2.5, 4.0):
        r.append_output_token_ids([3], now=t)
    r.finish_time = 4.0
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    m = r.metrics()
    assert (m.ttft, m.queue_time, m.e2e, m.tpot) == (1.0, 0.5, 3.0, 1.0)
    assert m.itl == [0.5, 1.5] and m.finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_batched_tokens": -5}, "max_num_batched_tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"max_num_seqs": 2.0}, "max_num_seqs"),
        ({"enable_chunked_prefill": "yes"}, "enable_chunked_prefill"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 8, "max_model_len": 16},
         "max_num_batched_tokens"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 8192, "long_prefill_token_threshold": 8},
         "long_prefill_token_threshold"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises((TypeError, ValueError), match=f"SchedulerConfig.{field}"):
        SchedulerConfig(**kwargs)


def test_scheduler_rejects_a_cache_shorter_than_max_model_len_and_unknown_policies():
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="float32")
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(spec, 8, max_model_len=32))
    with pytest.raises(ValueError, match="unknown scheduling policy 'round-robin'"):
        Scheduler(SchedulerConfig(), KVCacheManager(spec, 8), "round-robin")
    with pytest.raises(TypeError, match="SchedulerConfig"):
        Scheduler({"max_num_seqs": 4}, KVCacheManager(spec, 8))
    with pytest.raises(TypeError, match="SchedulingPolicy"):
        Scheduler(SchedulerConfig(), KVCacheManager(spec, 8), object())
    with pytest.raises(TypeError, match=r"KVCacheManagerProtocol: it lacks .*cache_blocks\(\)"):
        Scheduler(SchedulerConfig(), SimpleNamespace(block_size=4, enable_caching=False, get_computed_blocks=None,
                                                     allocate_slots=None, free=None, get_block_ids=None))
