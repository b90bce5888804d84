"""SamplingParams(n > 1) in the pipeline: a fan-out equals n independent requests with the children's
seeds (the reference), the prompt is prefilled once (children hit its cached blocks), outputs are grouped
per prompt, and every block comes back — also when a stream is closed early or the prompt is bad."""

import pytest
from hypothesis import given, settings, strategies as st

from servelab import Pipeline, SamplingParams
from servelab.pipeline.parallel_sampling import child_request_id, child_seed


@pytest.fixture(scope="module")
def pipes(tiny_path, one_torch_thread):
    return {caching: Pipeline.from_pretrained(tiny_path, block_size=4, num_blocks=256,
                                              enable_prefix_caching=caching) for caching in (True, False)}


def _all_blocks_free(pipe):
    return pipe.kv_cache_manager.num_free_blocks == pipe.num_blocks - 1 and not pipe._tracked \
        and not pipe._parallel.families


@settings(max_examples=12)
@given(n=st.integers(1, 4), seed=st.integers(0, 2**64 - 1), prompt_len=st.integers(1, 23),
       max_tokens=st.integers(1, 6), caching=st.booleans(), temperature=st.sampled_from([0.0, 0.7, 1.0]))
def test_fan_out_equals_independent_requests(pipes, n, seed, prompt_len, max_tokens, caching, temperature):
    pipe = pipes[caching]
    prompt = [(7 * k + 3) % 500 + 1 for k in range(prompt_len)]
    params = SamplingParams(n=n, seed=seed, max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    [out] = pipe.generate([prompt], params)
    reference = pipe.generate([prompt] * n, [SamplingParams(seed=child_seed(seed, i), max_tokens=max_tokens,
                                                            temperature=temperature, ignore_eos=True)
                                             for i in range(n)])
    assert [c.token_ids for c in out.outputs] == [r.token_ids for r in reference]
    assert [c.index for c in out.outputs] == list(range(n))
    assert out.token_ids == out.outputs[0].token_ids and out.finish_reason == "length"
    assert (out.completions is None) == (n == 1)
    full_prompt_blocks = (prompt_len - 1) // 4 * 4  # the last token is always computed
    for completion in out.outputs[1:]:
        cached = completion.metrics.num_cached_tokens
        assert cached >= full_prompt_blocks if caching else cached == 0
    assert _all_blocks_free(pipe)


def test_children_have_their_own_seed_streams(pipes):
    [out] = pipes[True].generate(["The cache line was evicted"], SamplingParams(n=4, seed=3, max_tokens=8))
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    assert len({child_seed(3, i) for i in range(4)}) == 4 and child_seed(3, 0) == 3


def test_outputs_grouped_per_prompt_and_streamed_by_completion(pipes):
    pipe = pipes[True]
    events = list(pipe.stream(["abc", "defg hij"], [SamplingParams(n=3, max_tokens=4, seed=1),
                                                     SamplingParams(n=2, max_tokens=3, seed=2)]))
    outs = pipe.last_outputs
    assert [o.index for o in outs] == [0, 1] and [len(o.outputs) for o in outs] == [3, 2]
    for out in outs:
        mine = [e for e in events if e.request_id == out.request_id]
        assert sum(e.finished for e in mine) == 1 and mine[-1].finished
        for c in out.outputs:
            assert [t for e in mine if e.completion_index == c.index for t in e.new_token_ids] == c.token_ids
            assert [e.finish_reason for e in mine if e.completion_index == c.index][-1] == "length"
    assert _all_blocks_free(pipe)


def test_closing_a_stream_early_aborts_every_child(pipes):
    pipe = pipes[True]
    stream = pipe.stream(["The cache line was evicted"], SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    [out] = pipe.last_outputs
    assert {c.finish_reason for c in out.outputs} == {"abort"} and out.finish_reason == "abort"
    assert _all_blocks_free(pipe)


def test_abort_request_of_a_parent_frees_children(pipes):
    pipe = pipes[True]
    rid = pipe.add_request("The cache", SamplingParams(n=3, max_tokens=30, ignore_eos=True), request_id="p")
    pipe.step()
    pipe.step()
    assert pipe.abort_request(rid) and not pipe.abort_request(rid)
    events = pipe.step()
    assert [e.finished for e in events if e.request_id == "p"][-1]
    assert pipe.get_output("p", pop=True).finish_reason == "abort"
    assert _all_blocks_free(pipe)


def test_bad_prompt_fails_every_completion_and_ids_are_checked(pipes):
    pipe = pipes[True]
    [out] = pipe.generate([[10**6]], SamplingParams(n=3, max_tokens=2))
    assert [c.finish_reason for c in out.outputs] == ["error"] * 3 and "vocabulary" in out.outputs[2].error
    pipe.add_request("x", SamplingParams(max_tokens=1), request_id=child_request_id("q", 1))
    with pytest.raises(ValueError, match="duplicate request_id 'q#1'"):
        pipe.add_request("x", SamplingParams(n=2), request_id="q")
    while pipe.has_unfinished_requests():
        pipe.step()
    pipe.get_output("q#1", pop=True)
    assert _all_blocks_free(pipe)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_n_is_validated(bad, error):
    with pytest.raises(error, match="SamplingParams.n"):
        SamplingParams(n=bad)
