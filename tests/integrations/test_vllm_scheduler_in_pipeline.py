"""``Pipeline(scheduler="vllm")``: vLLM's real v1 scheduler inside the servelab pipeline, on CPU.

Greedy outputs are token-identical to servelab's own scheduler with prefix caching on and a KV pool
small enough to preempt (both counted, so the test cannot pass with either path idle), on the tiny
model and on SmolLM2-135M (real checkpoint; skipped unless it is cached or
``SERVELAB_FETCH_REAL_CHECKPOINT=1``). Also: a bridged servelab policy, EOS / stop strings ending on
the same token, a failed step rolled back without leaking blocks, and a request that can never fit.
Skipped without vLLM.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from servelab import Pipeline, SamplingParams  # noqa: E402
from servelab.models import build_tiny_model, hub  # noqa: E402

PROMPTS = [f"A shared system prompt about paged caches, then question {i} " * (1 + i % 3) for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def run(path, scheduler, prompts=PROMPTS, params=GREEDY, **settings):
    pipe = Pipeline.from_pretrained(path, scheduler=scheduler, **settings)
    outs = pipe.generate(prompts, params)
    return pipe, outs, pipe.last_run_metrics


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.mark.parametrize("policy", ["fcfs", "sjf"])
def test_vllm_scheduler_is_token_identical_with_prefix_caching_and_preemption(tiny, policy):
    small = dict(num_blocks=40, block_size=4, policy=policy)
    _, ref, ref_metrics = run(tiny, "servelab", **small)
    pipe, outs, metrics = run(tiny, "vllm", **small)
    assert type(pipe.scheduler).__name__ == "VllmPipelineScheduler"
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref] == ["length"] * len(PROMPTS)
    assert metrics.num_preemptions > 0 and metrics.prefix_cache_hit_rate > 0  # both paths exercised
    assert 0 < max(metrics.kv_usage) <= 1  # vLLM's pool reports through the pipeline
    assert pipe.kv_cache_manager.num_free_blocks == 39  # every block back but the null block


def test_stops_end_on_the_same_token_as_servelab(tiny):
    params = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[t]) for t in (268, 170, 147)]
    prompts = ["The cache"] * 3
    _, ref, _ = run(tiny, "servelab", prompts, params)
    _, outs, _ = run(tiny, "vllm", prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(o.token_ids, o.finish_reason) for o in ref]
    assert any(o.finish_reason == "stop" for o in outs)


def test_a_failed_step_fails_its_requests_only_and_leaks_nothing(tiny):
    pipe = Pipeline.from_pretrained(tiny, scheduler="vllm", num_blocks=64, block_size=4)
    forward, calls = pipe.model.forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return forward(*args, **kwargs)

    pipe.model.forward = flaky
    outs = pipe.generate(["The cache", "A block table"], GREEDY)
    assert {o.finish_reason for o in outs} == {"error"} and "injected" in outs[0].error
    pipe.model.forward = forward
    again = pipe.generate(["The cache"], GREEDY)[0]
    fresh = Pipeline.from_pretrained(tiny, num_blocks=64, block_size=4).generate(["The cache"], GREEDY)[0]
    assert again.token_ids == fresh.token_ids
    assert pipe.kv_cache_manager.num_free_blocks == 63


def test_a_request_that_can_never_fit_fails_instead_of_waiting_forever(tiny):
    pipe = Pipeline.from_pretrained(tiny, scheduler="vllm", num_blocks=4, block_size=4)
    out = pipe.generate(["word " * 40], GREEDY)[0]  # its prompt alone does not fit
    assert out.finish_reason == "error" and "cannot fit" in out.error
    pipe = Pipeline.from_pretrained(tiny, scheduler="vllm", num_blocks=8, block_size=4)
    outs = pipe.generate(["The cache", "A block table"], SamplingParams(temperature=0, max_tokens=40))
    assert "error" in {o.finish_reason for o in outs}  # grows past the pool alone: fails, no endless retry
    assert all("cannot fit" in o.error for o in outs if o.finish_reason == "error")
    assert pipe.kv_cache_manager.num_free_blocks == 7


def test_speculative_decoding_is_refused_with_the_reason(tiny):
    with pytest.raises(ValueError, match="num_speculative_tokens=2.*scheduler='servelab'"):
        Pipeline.from_pretrained(tiny, scheduler="vllm", drafter="ngram", num_speculative_tokens=2)


@pytest.fixture(scope="module")
def smollm2():
    if not hub.is_fetched():
        if os.environ.get("SERVELAB_FETCH_REAL_CHECKPOINT") != "1":
            pytest.skip("SmolLM2 is not cached; set SERVELAB_FETCH_REAL_CHECKPOINT=1")
        hub.fetch_smollm2()
    return hub.smollm2_path()


def test_vllm_scheduler_is_token_identical_on_smollm2(smollm2):
    prompts = ["The capital of France is", "A paged KV cache stores", "The capital of France is a city",
               "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=10)
    small = dict(num_blocks=12, block_size=4)  # ~18 blocks wanted at the end: preemption
    _, ref, _ = run(smollm2, "servelab", prompts, params, **small)
    _, outs, metrics = run(smollm2, "vllm", prompts, params, **small)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert metrics.num_preemptions > 0 and metrics.prefix_cache_hit_rate > 0
