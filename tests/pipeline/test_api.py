"""The Pipeline's API: text prompts, streaming, stop conditions, bad input,
step-wise use, aborts, seeds, logprobs, metrics and the report."""

import json
import subprocess
import sys

import pytest
from pipeline_helpers import assert_no_leaks, random_prompts

from servelab import Pipeline, SamplingParams
from servelab.models import load_tokenizer
from servelab.pipeline import GenerationOutput, RunMetrics, StreamEvent

TEXTS = ["The cache holds", "On a quiet morning the baker", "for i in range(10):", "Boats carry wood"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def pipe(tiny):
    return Pipeline.from_pretrained(tiny["llama"], block_size=4)


@pytest.fixture(scope="module")
def reference(pipe):
    """Greedy outputs of TEXTS with no stop condition but max_tokens."""
    return pipe.generate(TEXTS, GREEDY)


def test_text_prompts_round_trip(pipe, reference, tiny):
    tok = load_tokenizer(tiny["llama"])
    for out, text in zip(reference, TEXTS):
        assert isinstance(out, GenerationOutput)
        assert out.prompt == text and out.prompt_token_ids == tok.encode(text)
        assert len(out.token_ids) == 24 and out.finish_reason == "length"
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        m = out.metrics
        assert m.ttft > 0 and m.e2e >= m.ttft and len(m.itl) == 23 and m.tpot > 0 and m.num_preemptions == 0
    assert_no_leaks(pipe)


def test_stream_adds_up_to_the_outputs(pipe, reference):
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=10), GREEDY,
              SamplingParams(temperature=0.0, max_tokens=24, stop=[reference[3].text[6:9]])]
    events = list(pipe.stream(TEXTS, params))
    assert all(isinstance(e, StreamEvent) for e in events)
    finals = pipe.last_outputs
    for out in finals:
        mine = [e for e in events if e.request_id == out.request_id]
        assert {e.index for e in mine} == {out.index}
        assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == out.finish_reason
        assert sum((e.new_token_ids for e in mine), []) == out.token_ids
        assert "".join(e.new_text for e in mine) == out.text
    assert [o.token_ids for o in finals[:3]] == [reference[0].token_ids, reference[1].token_ids[:10],
                                                reference[2].token_ids]
    assert finals[3].finish_reason == "stop"
    assert_no_leaks(pipe)


def test_stop_strings_cut_the_text_and_end_the_request(pipe, reference, tiny):
    tok = load_tokenizer(tiny["llama"])
    ref = reference[1]
    stop = ref.text[8:11]
    assert len(stop) == 3
    out = pipe.generate([TEXTS[1]], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop, "never-there"]))[0]
    cut = ref.text.find(stop)
    assert out.text == ref.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # tokens up to the one that completed the stop string
    n = next(i for i in range(1, 25) if stop in tok.decode(ref.token_ids[:i], skip_special_tokens=True))
    assert out.token_ids == ref.token_ids[:n]
    assert out.metrics.finish_reason == "stop" and out.metrics.num_output_tokens == n
    # streamed text never shows the stop string or a prefix of it that later completes
    events = list(pipe.stream([TEXTS[1]], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])))
    assert "".join(e.new_text for e in events) == ref.text[:cut]
    assert_no_leaks(pipe)


def test_stop_token_ids_eos_min_and_max_tokens(pipe, reference, tiny):
    ref = reference[0].token_ids
    stop_id = ref[5]
    first = ref.index(stop_id)
    out = pipe.generate([TEXTS[0]], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    later = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id], min_tokens=first + 2)
    out = pipe.generate([TEXTS[0]], later)[0]
    # min_tokens masks the stop id until then, so the model says something else there
    assert len(out.token_ids) >= first + 2 and stop_id not in out.token_ids[: first + 2]
    assert out.token_ids[:first] == ref[:first]
    out = pipe.generate([TEXTS[0]], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "length"
    # EOS (id 2) ends a request unless ignore_eos; logit_bias makes the model say it
    eos = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={2: 100.0})
    assert pipe.generate([TEXTS[0]], eos)[0].token_ids == [2]
    out = pipe.generate([TEXTS[0]], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={2: 100.0},
                                                   min_tokens=2))[0]
    assert out.token_ids[-1] == 2 and len(out.token_ids) == 3 and 2 not in out.token_ids[:2]
    assert_no_leaks(pipe)


def test_bad_requests_fail_alone(tiny):
    pipe = Pipeline.from_pretrained(tiny["llama"], max_model_len=64, block_size=4, num_blocks=12)
    good = random_prompts([5, 9], seed=1)
    prompts = [good[0], "", good[1], [5, 99999], [1, -3], [1] * 65, good[1], [1, 2.5], good[0],
               random_prompts([40])[0], []]
    params = [GREEDY] * len(prompts)
    params[8] = SamplingParams(stop_token_ids=[100000])
    params[2] = "not params"
    outs = pipe.generate(prompts, params)
    errors = {i: o.error for i, o in enumerate(outs) if o.finish_reason == "error"}
    assert sorted(errors) == [1, 2, 3, 4, 5, 7, 8, 9, 10]
    assert "empty" in errors[1] and "empty" in errors[10] and "SamplingParams" in errors[2]
    assert "99999" in errors[3] and "vocabulary" in errors[3] and "-3" in errors[4]
    assert "max_model_len=64" in errors[5] and "2.5" in errors[7] and "stop_token_ids" in errors[8]
    assert "cannot fit in the KV cache" in errors[9]  # 40 + 24 tokens > 11 blocks of 4
    clean = Pipeline.from_pretrained(tiny["llama"]).generate(good, GREEDY)
    assert [outs[0].token_ids, outs[6].token_ids] == [o.token_ids for o in clean]
    assert all(o.metrics is not None for o in outs)
    assert pipe.last_run_metrics.num_errors == 9 and pipe.last_run_metrics.num_requests == 11
    assert_no_leaks(pipe)
    with pytest.raises(ValueError, match="one per prompt"):
        pipe.generate(good, [GREEDY])


def test_step_wise_use_and_aborts(tiny):
    pipe = Pipeline.from_pretrained(tiny["mistral"], drafter="ngram", num_speculative_tokens=2)
    a = pipe.add_request("The cache holds", GREEDY)
    b = pipe.add_request([1, 7, 9, 11], GREEDY, request_id="mine", priority=0)
    assert b == "mine"
    with pytest.raises(ValueError, match="duplicate"):
        pipe.add_request([1, 2], request_id="mine")
    seen = []
    while pipe.has_unfinished_requests():
        events = pipe.step()
        seen += events
        if len(seen) >= 4 and not pipe.get_output(b).finished:
            assert pipe.abort_request(b)
    assert pipe.get_output(a).finish_reason == "length" and len(pipe.get_output(a).token_ids) == 24
    assert pipe.get_output(b, pop=True).finish_reason == "abort"
    assert not pipe.abort_request(a)  # already finished
    assert pipe.run_metrics().num_requests == 2
    assert_no_leaks(pipe)
    # a stream closed early aborts what it started
    stream = pipe.stream(TEXTS, GREEDY)
    next(stream)
    stream.close()
    assert {o.finish_reason for o in pipe.last_outputs} == {"abort"}
    assert_no_leaks(pipe)


def test_seeds_make_random_sampling_reproducible(tiny):
    prompts = random_prompts([3, 14, 30, 7], seed=12)
    seeded = [SamplingParams(temperature=1.0, top_k=50, seed=i, max_tokens=12) for i in range(4)]
    a = Pipeline.from_pretrained(tiny["qwen2"]).generate(prompts, seeded)
    b = Pipeline.from_pretrained(tiny["qwen2"], max_num_seqs=1).generate(prompts[::-1], seeded[::-1])[::-1]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]  # per-request seeds: batch-independent
    unseeded = SamplingParams(temperature=1.0, max_tokens=12)
    c = Pipeline.from_pretrained(tiny["qwen2"], seed=1).generate(prompts, unseeded)
    d = Pipeline.from_pretrained(tiny["qwen2"], seed=1).generate(prompts, unseeded)
    e = Pipeline.from_pretrained(tiny["qwen2"], seed=2).generate(prompts, unseeded)
    assert [o.token_ids for o in c] == [o.token_ids for o in d] != [o.token_ids for o in e]


def test_logprobs_and_priorities(tiny):
    pipe = Pipeline.from_pretrained(tiny["llama"], policy="priority", max_num_seqs=1)
    outs = pipe.generate(TEXTS[:3], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2),
                         priorities=[2, 0, 1])
    for o in outs:
        assert len(o.logprobs) == 4
        for token, entry in zip(o.token_ids, o.logprobs):
            (sampled, lp), (top1, lp1), _ = entry
            assert sampled == token == top1 and lp == lp1 <= 0.0
    first = [o.metrics.first_token_time for o in outs]
    assert first[1] < first[2] < first[0]  # served in priority order


def test_metrics_table_dict_and_report(pipe, tmp_path):
    pipe.generate(TEXTS, GREEDY, use_tqdm=True)
    m = pipe.last_run_metrics
    assert isinstance(m, RunMetrics)
    assert m.num_requests == 4 and m.output_tokens == 96 and m.throughput_tok_s > 0
    assert m.num_steps == len(m.kv_usage) == len(m.batch_sizes) == len(m.scheduled_tokens)
    assert max(m.batch_sizes) == 4 and 0 < max(m.kv_usage) <= 1 and m.acceptance_rate is None
    assert m.ttft.count == 4 and m.itl.count == 4 * 23 and m.e2e.p99 >= m.e2e.p50
    assert "throughput" in m.table() and "TTFT" in m.table()
    json.dumps(m.to_dict())
    from servelab.pipeline.report import plot_report

    path = plot_report(m, tmp_path / "report.png")
    assert path.stat().st_size > 10_000
    assert plot_report({"fcfs": m, "again": m}, tmp_path / "sub" / "two.svg").is_file()  # labelled runs


def test_import_servelab_stays_cheap():
    code = "import sys, servelab; assert 'servelab.pipeline' not in sys.modules and 'torch' not in sys.modules; " \
           "servelab.Pipeline; assert 'servelab.pipeline' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_built_from_components(tiny):
    from pipeline_helpers import hf_greedy

    from servelab.attention.backends import get_attention_backend
    from servelab.blocks import KVCacheManager
    from servelab.models import kv_cache_spec, load_model
    from servelab.samplers import Sampler
    from servelab.scheduling import FCFSPolicy

    model, _ = load_model(tiny["qwen2"])
    manager = KVCacheManager(kv_cache_spec(model, 8), 40, enable_caching=False, max_model_len=128)
    pipe = Pipeline(model, load_tokenizer(tiny["qwen2"]), attention_backend=get_attention_backend("torch"),
                    kv_cache_manager=manager, max_num_batched_tokens=32, max_num_seqs=3, policy=FCFSPolicy(),
                    sampler=Sampler(backend="torch"))
    assert pipe.scheduler.config.max_num_batched_tokens == 32 and not pipe.config.cache.enable_prefix_caching
    assert (pipe.block_size, pipe.num_blocks, pipe.max_model_len) == (8, 40, 128)
    prompts = random_prompts([3, 30, 12, 21], seed=15)
    outs = pipe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    assert [o.token_ids for o in outs] == hf_greedy(tiny["qwen2"], prompts, 10)
    assert max(pipe.last_run_metrics.batch_sizes) <= 3
    assert_no_leaks(pipe)


def test_configuration_errors_name_the_problem(tiny):
    from servelab.blocks import KVCacheManager
    from servelab.models import kv_cache_spec, load_model

    class Picky:
        name = "picky"

        def reshape_and_cache(self, *args, **kwargs):
            raise AssertionError("never called")

        paged_attention = reshape_and_cache

        def supports(self, query, key_cache=None, **kwargs):
            return f"head size {query.shape[-1]} is not my size"

    with pytest.raises(ValueError, match="'picky' cannot run this model: head size 16"):
        Pipeline.from_pretrained(tiny["llama"], attention_backend=Picky())
    with pytest.raises(ValueError, match="max_model_len=1000"):
        Pipeline.from_pretrained(tiny["llama"], max_model_len=1000)
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        Pipeline("not a model")
    model, _ = load_model(tiny["llama"])
    manager = KVCacheManager(kv_cache_spec(model, 8), 40, max_model_len=128)
    with pytest.raises(ValueError, match="block_size given together with kv_cache_manager"):
        Pipeline(model, kv_cache_manager=manager, block_size=16)


def test_generate_freezes_the_heap_for_its_loop_only_and_never_thaws_a_users_freeze(pipe, reference, monkeypatch):
    import gc

    seen = []
    real_step = pipe.step

    def step():
        seen.append(gc.get_freeze_count())
        return real_step()

    monkeypatch.setattr(pipe, "step", step)
    assert gc.get_freeze_count() == 0
    assert [o.token_ids for o in pipe.generate(TEXTS, GREEDY)] == [o.token_ids for o in reference]
    assert seen and min(seen) > 0  # frozen while stepping
    assert gc.get_freeze_count() == 0  # and thawed after
    calls = []
    monkeypatch.setattr(gc, "freeze", lambda real=gc.freeze: calls.append("freeze") or real())
    monkeypatch.setattr(gc, "unfreeze", lambda real=gc.unfreeze: calls.append("unfreeze") or real())
    gc.freeze()  # the user's own freeze: generate leaves it alone
    try:
        calls.clear()
        pipe.generate(TEXTS[:1], GREEDY)
        assert calls == [] and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    calls.clear()
    pipe.generate(TEXTS[:1], GREEDY)
    assert calls == ["freeze", "unfreeze"]
    with pytest.raises(ValueError):
        pipe.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=4, top_k=-5))
    assert gc.get_freeze_count() == 0  # a run that raises thaws too
