"""Greedy ``Pipeline.generate`` against transformers' ``generate`` on the same
tiny checkpoints, token for token, for a batch of prompts of mixed lengths —
and the same outputs whatever the engine does on the way: no prefix caching,
small blocks, chunked prefill at several budgets, a KV pool so small that
requests are preempted and recomputed, speculative decoding (n-gram and draft
model), another policy, the Triton attention backend (interpreter)."""

import pytest
from pipeline_helpers import ARCHS, assert_no_leaks, hf_greedy, random_prompts

from servelab import Pipeline
from servelab.samplers import SamplingParams

LENGTHS = (1, 6, 19, 40, 11)  # Mistral's window is 16: the longer ones cross it
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def expected(tiny):
    """arch -> (prompts, transformers' greedy outputs)."""
    out = {}
    for arch in ARCHS:
        prompts = random_prompts(LENGTHS, seed=7)
        out[arch] = (prompts, hf_greedy(tiny[arch], prompts, MAX_TOKENS))
    return out


def run(path, prompts, params=GREEDY, **kwargs):
    pipe = Pipeline.from_pretrained(path, **kwargs)
    outs = pipe.generate(prompts, params)
    assert [o.index for o in outs] == list(range(len(prompts)))
    assert_no_leaks(pipe)
    return outs, pipe


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_matches_transformers(tiny, expected, arch):
    prompts, want = expected[arch]
    outs, pipe = run(tiny[arch], prompts)
    assert [o.token_ids for o in outs] == want
    assert len({tuple(w) for w in want}) == len(want)  # not degenerate
    for o, w in zip(outs, want):
        assert o.finish_reason == ("stop" if w[-1] == 2 else "length")
        assert o.prompt_token_ids == prompts[o.index] and o.error is None
    assert pipe.last_run_metrics.num_requests == len(prompts)


VARIANTS = {
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "block_size_4": dict(block_size=4),
    "chunked_budget_3": dict(max_num_batched_tokens=3),
    "chunked_budget_7_threshold_5": dict(max_num_batched_tokens=7, long_prefill_token_threshold=5),
    "chunked_budget_24_threshold_8": dict(max_num_batched_tokens=24, long_prefill_token_threshold=8),
    "one_at_a_time_sjf": dict(max_num_seqs=1, policy="sjf"),
    "preemption": dict(block_size=4, num_blocks=18),
    "preemption_no_caching": dict(block_size=4, num_blocks=18, enable_prefix_caching=False),
    "ngram_k3": dict(drafter="ngram", num_speculative_tokens=3),
    "draft_model_k3": dict(drafter="draft", num_speculative_tokens=3),
    "draft_model_k2_preemption": dict(drafter="draft", num_speculative_tokens=2, block_size=4, num_blocks=20),
    "sdpa_backend": dict(attention_backend="sdpa"),
    "sdpa_backend_chunked_preemption": dict(attention_backend="sdpa", block_size=4, num_blocks=18,
                                            max_num_batched_tokens=7),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_same_greedy_output_under(tiny, expected, arch, variant):
    prompts, want = expected[arch]
    kwargs = dict(VARIANTS[variant])
    if kwargs.get("drafter") == "draft":
        kwargs["drafter"] = tiny["draft"]
    outs, pipe = run(tiny[arch], prompts, **kwargs)
    assert [o.token_ids for o in outs] == want
    m = pipe.last_run_metrics
    if "preemption" in variant:
        assert m.num_preemptions > 0
        assert sum(o.metrics.num_preemptions for o in outs) == m.num_preemptions
    if "chunked" in variant:
        assert max(m.scheduled_tokens) <= kwargs["max_num_batched_tokens"]
    if "drafter" in kwargs:
        assert m.acceptance_rate is not None and 0.0 <= m.acceptance_rate <= 1.0
        assert m.num_draft_tokens > 0
    else:
        assert m.acceptance_rate is None


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_prefix_cache_hits_give_the_same_output(tiny, arch):
    """Prompts sharing a 33-token prefix, run twice: the second run is served
    mostly from the cache and must not change a token."""
    base = random_prompts([33], seed=3)[0]
    tails = random_prompts([3, 9, 17], seed=4)
    prompts = [base + t[1:] for t in tails]
    want = hf_greedy(tiny[arch], prompts, 8)
    pipe = Pipeline.from_pretrained(tiny[arch], block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    first = pipe.generate(prompts, params)
    second = pipe.generate(prompts, params)
    assert [o.token_ids for o in first] == want
    assert [o.token_ids for o in second] == want
    assert pipe.last_run_metrics.prefix_cache_hit_rate > 0.5
    assert all(o.metrics.num_cached_tokens > 0 for o in second)
    assert_no_leaks(pipe)


@pytest.mark.interpreter
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_triton_backend_matches_transformers(tiny, arch):
    """The Triton kernels (interpreted on CPU) in the whole pipeline: a smaller case."""
    prompts = random_prompts([4, 19], seed=11)
    want = hf_greedy(tiny[arch], prompts, 5)
    outs, _ = run(tiny[arch], prompts, SamplingParams(temperature=0.0, max_tokens=5), attention_backend="triton",
                  block_size=8, max_num_batched_tokens=16)
    assert [o.token_ids for o in outs] == want
