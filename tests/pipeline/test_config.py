"""PipelineConfig: one source of defaults, flat names, validation, and the
pipeline built from it (constructor and from_pretrained agree)."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab import CacheConfig, Pipeline, PipelineConfig, SamplingParams, SchedulingConfig, SpeculativeConfig
from servelab.config import flat_names
from servelab.scheduling import SchedulerConfig
from servelab.models import load_model, load_tokenizer


def test_top_level_imports_are_lazy_and_complete():
    import subprocess
    import sys

    code = ("import sys, servelab; assert 'torch' not in sys.modules; "
            "from servelab import PipelineConfig; assert 'torch' not in sys.modules; "
            "from servelab import Pipeline, SamplingParams; assert 'servelab.pipeline' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


_VALUES = {
    "block_size": st.integers(1, 64), "num_blocks": st.none() | st.integers(2, 10_000),
    "enable_prefix_caching": st.booleans(), "kv_cache_memory_bytes": st.none() | st.integers(1, 1 << 40),
    "eviction_policy": st.sampled_from(["lru", "lfu"]), "kv_cache_groups": st.sampled_from(["auto", "uniform"]),
    "policy": st.sampled_from(["fcfs", "sjf", "vtc"]),
    "max_num_seqs": st.integers(1, 512), "max_num_batched_tokens": st.integers(1, 8192),
    "long_prefill_token_threshold": st.integers(0, 64), "max_model_len": st.none() | st.integers(1, 1 << 15),
    "enable_chunked_prefill": st.just(True), "verifier": st.sampled_from(["rejection", "typical", "tree"]),
    "attention_backend": st.sampled_from(["auto", "torch", "sdpa"]), "seed": st.none() | st.integers(-5, 1 << 40),
    "max_logprobs": st.integers(0, 100), "grammar_backend": st.just("xgrammar"),
    "kv_cache_dtype": st.sampled_from(["auto", "int8", "fp8", "fp8_e5m2"]), "kv_cache_scale": st.none(),
    "quantization": st.sampled_from(["auto", None, "int8", "w4a16"]),
    "enable_lora": st.booleans(), "max_loras": st.integers(1, 8), "max_lora_rank": st.integers(1, 256),
    "max_cpu_loras": st.none(), "tensor_parallel_size": st.integers(1, 8), "pipeline_parallel_size": st.integers(1, 4),
    "data_parallel_size": st.integers(1, 4), "distributed_executor_backend": st.sampled_from([None, "multiproc"]),
    "enable_expert_parallel": st.booleans(),
}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_flat_settings_round_trip(data):
    assert set(_VALUES) | {"drafter", "num_speculative_tokens"} == set(flat_names())
    flat = {name: data.draw(strategy, label=name) for name, strategy in _VALUES.items()
            if data.draw(st.booleans(), label=f"set {name}")}
    if data.draw(st.booleans(), label="speculative"):
        flat.update(drafter="ngram", num_speculative_tokens=data.draw(st.integers(1, 5)))
    if flat.get("num_blocks") is not None and flat.get("kv_cache_memory_bytes") is not None:
        del flat["num_blocks"]  # both size the pool: refused (test_bad_settings...)
    config = PipelineConfig.from_kwargs(**flat)
    assert {k: v for k, v in config.to_flat().items() if k in flat} == flat
    assert PipelineConfig.from_kwargs(**config.to_flat()) == config
    assert config.replace() == config and PipelineConfig().replace(**flat) == config
    for name, value in flat.items():  # each flat name lands in its section
        section = flat_names()[name]
        owner = config if section == "top" else getattr(config, section)
        assert getattr(owner, name) == value
    if config.scheduler.max_model_len is not None:
        sched = config.scheduler_config(config.scheduler.max_model_len)
        assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.num_speculative_tokens) == (
            config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
            config.speculative.num_speculative_tokens)


@pytest.mark.parametrize("settings_, error, words", [
    (dict(seed=1.5), TypeError, ["seed=1.5", "int or None"]),
    (dict(seed="x"), TypeError, ["seed='x'", "int or None"]),
    (dict(seed=True), TypeError, ["seed=True"]),
    (dict(kv_cache_memory_bytes=-5), ValueError, ["kv_cache_memory_bytes=-5", ">= 1"]),
    (dict(kv_cache_memory_bytes=2.5), TypeError, ["kv_cache_memory_bytes=2.5"]),
    (dict(block_size=0), ValueError, ["block_size=0"]),
    (dict(kv_cache_groups="hybrid"), ValueError, ["kv_cache_groups='hybrid'", "'auto', 'uniform'"]),
    (dict(kv_cache_groups=2), TypeError, ["kv_cache_groups=2"]),
    (dict(num_blocks=1), ValueError, ["num_blocks=1", ">= 2"]),
    (dict(max_num_seqs=True), TypeError, ["max_num_seqs=True"]),
    (dict(enable_prefix_caching=1), TypeError, ["enable_prefix_caching", "bool"]),
    (dict(policy=""), ValueError, ["policy=''"]),
    (dict(drafter="ngram"), ValueError, ["num_speculative_tokens=0", "or neither"]),
    (dict(num_speculative_tokens=2), ValueError, ["drafter=None"]),
    (dict(max_logprobs=-1), ValueError, ["max_logprobs=-1"]),
    (dict(blocksize=16), TypeError, ["'blocksize'", "valid:", "block_size", "verifier"]),
    (dict(num_blocks=10, kv_cache_memory_bytes=1 << 20), ValueError, ["num_blocks=10", "kv_cache_memory_bytes",
                                                                      "give one"]),
    (dict(kv_cache_dtype="fp4"), ValueError, ["kv_cache_dtype='fp4'", "'int8'"]),
    (dict(kv_cache_scale="head"), ValueError, ["kv_cache_scale='head'", "kv_cache_dtype='auto'"]),
    (dict(kv_cache_dtype="int8", kv_cache_scale="row"), ValueError, ["kv_cache_scale='row'", "'token_head'"]),
    (dict(max_loras=4, max_cpu_loras=2), ValueError, ["max_cpu_loras=2", "max_loras=4"]),
    (dict(tensor_parallel_size=0), ValueError, ["tensor_parallel_size=0"]),
    (dict(quantization=3), TypeError, ["quantization=3"]),
])
def test_bad_settings_name_the_field_and_what_is_valid(settings_, error, words):
    with pytest.raises(error) as info:
        PipelineConfig.from_kwargs(**settings_)
    for word in words:
        assert word in str(info.value)


def test_sections_are_frozen_and_checked():
    config = PipelineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 3
    with pytest.raises(TypeError, match="PipelineConfig.cache must be a CacheConfig"):
        PipelineConfig(cache=SchedulingConfig())
    custom = PipelineConfig(cache=CacheConfig(block_size=8), speculative=SpeculativeConfig("ngram", 2))
    assert custom.replace(cache=CacheConfig()).cache.block_size == 16
    assert custom.replace(block_size=4).speculative == custom.speculative


def test_pipeline_and_from_pretrained_share_one_set_of_defaults(tiny):
    path = tiny["llama"]
    model, _ = load_model(path)
    a = Pipeline(model, load_tokenizer(path))
    b = Pipeline.from_pretrained(path)
    assert a.config == b.config == PipelineConfig()
    assert a.attention_backend == b.attention_backend == "sdpa"  # "auto" on a CPU when SDPA supports the model
    sched = b.scheduler.config
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len) == (
        SchedulerConfig.max_num_seqs, SchedulerConfig.max_num_batched_tokens, model.config.max_position_embeddings)
    assert b.kv_cache_manager.enable_caching and b.verifier.name == "rejection" and b.drafter is None
    # settings fill the config; the scheduler config is derived from it
    c = Pipeline.from_pretrained(path, config=PipelineConfig.from_kwargs(max_num_seqs=3), block_size=8,
                                 policy="sjf", max_model_len=128, attention_backend="torch")
    assert c.config.scheduler.max_num_seqs == c.scheduler.config.max_num_seqs == 3
    assert (c.block_size, c.max_model_len, c.scheduler.config.max_model_len, c.attention_backend) == (
        8, 128, 128, "torch")
    out = c.generate([[1, 5, 9]], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert out.finish_reason == "length"
    d = Pipeline.from_pretrained(path, eviction_policy="lfu", enable_prefix_caching=False, num_blocks=20)
    pool = d.kv_cache_manager.block_pool
    assert pool.eviction_policy.name == "lfu" and pool.num_blocks == d.num_blocks == 20
    assert not d.kv_cache_manager.enable_caching
    assert d.generate([[1, 5, 9]], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids == out.token_ids


def test_constructor_errors(tiny):
    path = tiny["llama"]
    for bad, error in ((dict(seed=1.5), TypeError), (dict(seed="x"), TypeError),
                       (dict(kv_cache_memory_bytes=-5), ValueError)):
        with pytest.raises(error, match=next(iter(bad))):
            Pipeline.from_pretrained(path, **bad)
    with pytest.raises(TypeError, match="unknown setting.*'scheduler_config'"):
        Pipeline.from_pretrained(path, scheduler_config=None)
    with pytest.raises(TypeError, match="PipelineConfig"):
        Pipeline.from_pretrained(path, config={"block_size": 8})
    with pytest.raises(ValueError, match="max_model_len=1000"):
        Pipeline.from_pretrained(path, max_model_len=1000)
    with pytest.raises(ValueError, match="unknown verifier 'nope'"):
        Pipeline.from_pretrained(path, verifier="nope")


def test_default_pool_is_sized_to_the_run_and_reported(tiny):
    from servelab.pipeline.sizing import default_num_blocks, model_weight_bytes

    pipe = Pipeline.from_pretrained(tiny["llama"], max_num_seqs=2, max_model_len=64, block_size=16)
    assert pipe.num_blocks == 2 * 4 + 1  # what two 64-token requests can hold, nothing more
    spec = pipe.kv_cache_manager.spec
    layers = pipe.model_config.num_hidden_layers
    budget = 10 * spec.page_size_bytes * layers
    assert default_num_blocks(spec, layers, max_model_len=64, max_num_seqs=64, kv_cache_memory_bytes=budget) == 10
    big = default_num_blocks(spec, layers, max_model_len=128, max_num_seqs=10_000, model=pipe.model)
    per_block = spec.page_size_bytes * layers
    assert big * per_block <= max(model_weight_bytes(pipe.model) // 2, 64 << 20) + per_block
    pipe.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))
    m = pipe.last_run_metrics
    assert m.kv_cache_bytes == pipe.kv_cache_bytes == pipe.num_blocks * per_block
    assert m.peak_rss_bytes > 10 << 20 and "peak RSS" in m.table()
