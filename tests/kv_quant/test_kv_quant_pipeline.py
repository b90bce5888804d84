"""The ``kv_cache_dtype`` setting end to end on the tiny model: pages, pool bytes, greedy outputs,
prefix-cache reuse of quantized blocks, static scales, and the refusals (nothing allocated)."""

from __future__ import annotations

import pytest
import torch

from servelab import Pipeline, SamplingParams
from servelab.models import build_tiny_model

PROMPTS = ["The cache line was evicted", "A block table maps", "Once upon a time there", "hello world, said"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("kvq") / "tiny", arch="llama")


@pytest.fixture(scope="module")
def auto_outputs(tiny):
    return [o.token_ids for o in Pipeline.from_pretrained(tiny).generate(PROMPTS, GREEDY)]


def test_int8_token_head_greedy(tiny, auto_outputs):
    """Both torch paths give the same tokens over int8 pages, and (random weights: near-ties are
    common, so not every prompt) most prompts equal the float32 cache's; SmolLM2's real check is in
    test_kv_quant_real.py."""
    results = []
    for backend in ("sdpa", "torch"):
        pipe = Pipeline.from_pretrained(tiny, kv_cache_dtype="int8", attention_backend=backend)
        key_cache, value_cache, k_scale, v_scale = pipe.kv_caches.views[0]
        assert key_cache.dtype == torch.int8 and k_scale.dtype == torch.float32
        assert k_scale.shape == key_cache.shape[:3]
        outs = pipe.generate(PROMPTS, GREEDY)
        assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
        results.append([o.token_ids for o in outs])
    assert results[0] == results[1]
    assert sum(a[:2] == b[:2] for a, b in zip(results[0], auto_outputs)) >= 3


def test_fp8_backends_agree_and_prefix_cache_reuses_quantized_blocks(tiny):
    results = []
    for backend in ("sdpa", "torch"):
        pipe = Pipeline.from_pretrained(tiny, kv_cache_dtype="fp8", attention_backend=backend, block_size=4)
        assert pipe.kv_caches.views[0][0].dtype == torch.float8_e4m3fn
        first = [o.token_ids for o in pipe.generate(PROMPTS, GREEDY)]
        again = pipe.generate(PROMPTS, GREEDY)  # the prompts' full blocks hit the prefix cache
        assert [o.token_ids for o in again] == first
        assert sum(o.metrics.num_cached_tokens for o in again) > 0
        results.append(first)
    assert results[0] == results[1]


def test_pool_is_sized_from_bytes(tiny):
    budget = 1 << 20
    auto = Pipeline.from_pretrained(tiny, kv_cache_memory_bytes=budget)
    int8 = Pipeline.from_pretrained(tiny, kv_cache_memory_bytes=budget, kv_cache_dtype="int8")
    page_auto = auto.kv_cache_manager.spec.page_size_bytes
    page_int8 = int8.kv_cache_manager.spec.page_size_bytes
    head = auto.model.config.head_dim
    assert page_int8 * 4 * head == page_auto * (head + 4)  # data (1 of 4 bytes) plus a float32 scale per row
    assert int8.num_blocks >= 2.5 * auto.num_blocks
    assert int8.kv_cache_bytes <= budget and auto.kv_cache_bytes <= budget


def test_static_scales_live_outside_the_pages(tiny):
    pipe = Pipeline.from_pretrained(tiny, kv_cache_dtype="int8", kv_cache_scale="head")
    static = pipe.kv_caches.static_scales
    layers = pipe.model.config.num_hidden_layers
    assert static.shape == (layers, 2, pipe.model.config.num_key_value_heads)
    assert pipe.kv_cache_manager.spec.page_size_bytes == pipe.kv_cache_manager.spec.block_size * 2 * \
        pipe.model.config.num_key_value_heads * pipe.model.config.head_dim
    k_scale = pipe.kv_caches.views[1][2]
    static[1, 0].fill_(0.5)
    assert bool((k_scale == 0.5).all())


@pytest.mark.parametrize("settings, match", [
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype='int4' is invalid"),
    ({"kv_cache_dtype": "int8", "kv_cache_scale": "channel"}, "kv_cache_scale='channel' is invalid"),
    ({"kv_cache_scale": "head"}, "kv_cache_dtype='auto'"),
    ({"kv_cache_dtype": "int8", "attention_backend": "triton_without_int8"}, "cannot read kv_cache_dtype='int8'"),
])
def test_bad_settings_refused(tiny, settings, match):
    from servelab.attention import AttentionCapabilities, register_attention_backend
    from servelab.attention.backends import TritonAttentionBackend, _REGISTRY

    class NoInt8(TritonAttentionBackend):
        name = "triton_without_int8"
        capabilities = AttentionCapabilities(device_types=("cpu",))

    register_attention_backend("triton_without_int8", NoInt8, override=True)
    try:
        with pytest.raises(ValueError, match=match):
            Pipeline.from_pretrained(tiny, **settings)
    finally:
        _REGISTRY._entries.pop("triton_without_int8", None)


def test_calibrated_static_scales_beat_the_default_and_round_trip(tiny, auto_outputs, tmp_path):
    from servelab.pipeline.kv_calibration import calibrate_kv_scales, load_kv_scales, save_kv_scales

    default = Pipeline.from_pretrained(tiny, kv_cache_dtype="int8", kv_cache_scale="head")
    uncalibrated = [o.token_ids for o in default.generate(PROMPTS, GREEDY)]
    scales = calibrate_kv_scales(default, PROMPTS)
    assert scales.shape == default.kv_caches.static_scales.shape and bool((scales != 1.0).all())
    calibrated = [o.token_ids for o in default.generate(PROMPTS, GREEDY)]
    agree = lambda outs: sum(a[:2] == b[:2] for a, b in zip(outs, auto_outputs))  # noqa: E731
    assert agree(calibrated) > agree(uncalibrated)
    save_kv_scales(default, tmp_path / "scales.pt")
    other = Pipeline.from_pretrained(tiny, kv_cache_dtype="int8", kv_cache_scale="head")
    load_kv_scales(other, tmp_path / "scales.pt")
    assert torch.equal(other.kv_caches.static_scales, default.kv_caches.static_scales)
    per_tensor = Pipeline.from_pretrained(tiny, kv_cache_dtype="int8", kv_cache_scale="tensor")
    with pytest.raises(ValueError, match="kv_cache_scale='head'; this pipeline has kv_cache_scale='tensor'"):
        load_kv_scales(per_tensor, tmp_path / "scales.pt")
    assert bool((per_tensor.kv_caches.static_scales == 1.0).all())  # nothing written
    torch.save({"scales": torch.ones(3, 2, 1), "kv_cache_dtype": "int8", "kv_cache_scale": "head"},
               tmp_path / "wrong.pt")
    with pytest.raises(ValueError, match=r"shape \(3, 2, 1\); this model needs"):
        load_kv_scales(other, tmp_path / "wrong.pt")
    token_head = Pipeline.from_pretrained(tiny, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="no static scales to calibrate"):
        calibrate_kv_scales(token_head, PROMPTS)


@pytest.mark.parametrize("scale", ["token_head", "head"])
def test_hybrid_groups_store_quantized_pages(tmp_path_factory, scale):
    """Gemma 2 (alternating sliding-window / full layers): one KV-cache group per kind in one shared
    buffer, int8 pages in every group, static scales per model layer; the same tokens as one uniform
    group over the same quantized pages (the windows then applied as masks only)."""
    path = build_tiny_model(tmp_path_factory.mktemp("kvq-g2") / "g2", arch="gemma2")
    results = []
    for groups in ("auto", "uniform"):
        pipe = Pipeline.from_pretrained(path, kv_cache_dtype="int8", kv_cache_scale=scale, attention_backend="torch",
                                        block_size=4, kv_cache_groups=groups)
        assert (pipe.kv_cache_groups is not None) == (groups == "auto")
        assert all(view[0].dtype == torch.int8 and len(view) == 4 for view in pipe.kv_caches.views)
        if scale == "head":
            static = pipe.kv_caches.static_scales
            assert static.shape[0] == pipe.model.config.num_hidden_layers
            static.copy_(torch.linspace(0.01, 0.05, static.numel()).view_as(static))
        prompt = list(range(3, 30))  # longer than the tiny Gemma 2's window
        results.append(pipe.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].token_ids)
    assert results[0] == results[1] and len(results[0]) == 6
