"""Random engine configurations must not change greedy outputs, and must not leak.

Hypothesis draws a workload (prompt lengths, shared prefixes, max_tokens) and
an engine (block size, a pool from barely-enough to ample, token budget and
per-request threshold, batch cap, policy, prefix caching, speculative
decoding); the outputs must equal those of a roomy reference engine, every
request must end exactly once, and every block must be free afterwards."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeline_helpers import assert_no_leaks, random_prompts

from servelab import Pipeline
from servelab.samplers import SamplingParams


@pytest.fixture(scope="module")
def roomy(tiny):
    return Pipeline.from_pretrained(tiny["mistral"], block_size=16, enable_prefix_caching=False)


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    prompts = random_prompts(lengths, seed=draw(st.integers(0, 1000)))
    if n > 1 and draw(st.booleans()):  # a shared prefix, for the prefix cache
        prompts = [prompts[0] + p[1:] for p in prompts]
    max_tokens = draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    return prompts, max_tokens


@st.composite
def engines(draw, longest: int):
    block_size = draw(st.sampled_from([2, 4, 8]))
    spec = draw(st.sampled_from([None, "ngram", "draft"]))
    k = draw(st.integers(1, 3)) if spec else 0
    need = -(-(longest + k) // block_size) + 1  # the longest request alone, plus the null block
    kwargs = dict(
        block_size=block_size, num_blocks=draw(st.integers(need, need * 4)),
        max_num_batched_tokens=draw(st.integers(1 + k, 40)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 3, 7])),
        max_num_seqs=draw(st.integers(1, 5)), policy=draw(st.sampled_from(["fcfs", "priority", "sjf", "vtc"])),
        enable_prefix_caching=draw(st.booleans()),
    )
    if spec:
        kwargs.update(drafter=spec, num_speculative_tokens=k)
    return kwargs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_any_engine_gives_the_roomy_engines_output(tiny, roomy, data):
    prompts, max_tokens = data.draw(workloads())
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    kwargs = data.draw(engines(longest))
    if kwargs.get("drafter") == "draft":
        kwargs["drafter"] = tiny["draft"]
    pipe = Pipeline.from_pretrained(tiny["mistral"], **kwargs)
    outs = pipe.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    m = pipe.last_run_metrics
    assert m.num_requests == len(prompts) and m.output_tokens == sum(max_tokens)
    assert max(m.scheduled_tokens) <= kwargs["max_num_batched_tokens"]
    assert max(m.batch_sizes) <= kwargs["max_num_seqs"]
    assert_no_leaks(pipe)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_seeded_sampling_does_not_depend_on_the_engine(roomy, tiny, data):
    """A seeded request's noise is a function of (seed, tokens so far): batching,
    chunking, preemption and recompute must not change what it samples."""
    prompts, max_tokens = data.draw(workloads())
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=m, ignore_eos=True)
              for i, m in enumerate(max_tokens)]
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    kwargs = data.draw(engines(max(len(p) + m for p, m in zip(prompts, max_tokens))))
    for key in ("drafter", "num_speculative_tokens"):  # drafts change how random noise is consumed
        kwargs.pop(key, None)
    pipe = Pipeline.from_pretrained(tiny["mistral"], **kwargs)
    assert [o.token_ids for o in pipe.generate(prompts, params)] == want
    assert_no_leaks(pipe)
