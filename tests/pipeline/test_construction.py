"""The pipeline's construction path: model steps in order, pool bounds checked before allocation."""

import time

import pytest

from servelab import Pipeline, PipelineConfig
from servelab.pipeline import setup
from servelab.pipeline.setup import ModelStep, prepare_model


@pytest.fixture(scope="module")
def tiny_model_path(tiny):
    return tiny["llama"]


def test_model_steps_run_in_order_and_only_when_active(tiny_model_path, monkeypatch):
    from servelab.models import load_model

    model, _ = load_model(tiny_model_path)
    calls = []
    import sys
    import types

    mod = types.ModuleType("servelab_test_steps")
    mod.first = lambda m, c, **ctx: calls.append(("first", ctx)) or m
    mod.second = lambda m, c, **ctx: calls.append(("second", ctx)) or m
    monkeypatch.setitem(sys.modules, "servelab_test_steps", mod)
    steps = (ModelStep("a", "servelab_test_steps:first", lambda c: True),
             ModelStep("b", "servelab_test_steps:never", lambda c: False),
             ModelStep("c", "servelab_test_steps:second", lambda c: True))
    assert prepare_model(model, PipelineConfig(), steps=steps, rank=1) is model
    assert calls == [("first", {"rank": 1}), ("second", {"rank": 1})]


def test_a_step_missing_from_the_build_is_refused_naming_its_setting(tiny_model_path):
    from servelab.models import load_model

    model, _ = load_model(tiny_model_path)
    steps = (ModelStep("enable_lora", "servelab_no_such_module:attach", lambda c: True),)
    with pytest.raises(ValueError, match="enable_lora is set"):
        prepare_model(model, PipelineConfig(), steps=steps)


def test_the_default_config_applies_no_step():
    config = PipelineConfig()
    assert [s.setting for s in setup.MODEL_STEPS if s.active(config)] == []


@pytest.mark.parametrize("settings, words", [
    (dict(num_blocks=1_000_000_000), ["num_blocks=1000000000", "GiB is free", "lower num_blocks"]),
    (dict(kv_cache_memory_bytes=1), ["kv_cache_memory_bytes=1", "at least"]),
])
def test_pool_bounds_are_checked_before_anything_is_allocated(tiny_model_path, settings, words):
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        Pipeline.from_pretrained(tiny_model_path, **settings)
    assert time.perf_counter() - start < 30  # a billion blocks used to grow the process for minutes
    for word in words:
        assert word in str(err.value)


def test_a_given_manager_is_folded_into_the_config_once(tiny_model_path):
    from servelab.blocks import KVCacheManager
    from servelab.models import kv_cache_spec, load_model

    model, _ = load_model(tiny_model_path)
    manager = KVCacheManager(kv_cache_spec(model, 8, model.dtype), 40, False)
    pipe = Pipeline(model, kv_cache_manager=manager)
    assert (pipe.config.cache.block_size, pipe.config.cache.num_blocks) == (8, 40)
    assert pipe.config.cache.enable_prefix_caching is False
