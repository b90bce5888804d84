"""Key smoothing (``key_smoothing_factors``, ``fold_key_smoothing``, ``calibrate_key_smoothing``):
the factors against their float64 reference, the fold held to the float64 smoothed-key reference on
the tiny models (per-head q/k norms: Gemma 3, Qwen 3; the fused projection: Llama, Qwen 2 with
biases), ``"auto"`` logits unchanged by the fold, and the refusals (nothing changed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab import Pipeline
from servelab.blocks.kv_quant import get_kv_cache_dtype, key_smoothing_factors
from servelab.models import allocate_kv_caches, build_tiny_model, llama, load_model, prepare_inputs
from servelab.pipeline.kv_calibration import (calibrate_key_smoothing, fold_key_smoothing,
                                              measure_key_channel_amax, smooth_model_keys)
from servelab.reference import kv_quant as ref_quant

ARCHS = ("gemma3_text", "qwen3", "llama", "qwen2")
TOKENS = [[1, 5, 9, 17, 33, 2, 7, 11, 40, 41, 3, 8, 13, 21, 34, 55, 89, 100, 4, 6, 12]]


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 3), heads=st.integers(1, 2), half=st.sampled_from((1, 2, 4, 8)),
       alpha=st.sampled_from((0.0, 0.25, 0.5, 1.0)), seed=st.integers(0, 2**16),
       dead=st.sampled_from(("none", "channel", "head")))
def test_factors_match_float64_reference(layers, heads, half, alpha, seed, dead):
    gen = torch.Generator().manual_seed(seed)
    amax = torch.rand((layers, heads, 2 * half), generator=gen, dtype=torch.float64) * 30
    if dead == "channel":
        amax[..., 0] = 0.0
        amax[..., half] = 0.0  # the pair is dead: floored, not divided by 0
    elif dead == "head":
        amax[0, 0] = 0.0  # all ones
    got = key_smoothing_factors(amax.float(), alpha)
    want = ref_quant.key_smoothing_factors(amax.float(), alpha)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want.double(), rtol=1e-6, atol=0)
    assert torch.equal(got[..., :half], got[..., half:])  # equal on RoPE pairs
    assert bool((got > 0).all()) and bool((got <= 1).all())


@pytest.mark.parametrize("bad, err", [(-0.1, ValueError), (1.5, ValueError), (True, ValueError)])
def test_factors_refuse_bad_alpha(bad, err):
    with pytest.raises(err, match="alpha"):
        key_smoothing_factors(torch.ones(4), bad)


def test_factors_refuse_odd_or_negative_amax():
    with pytest.raises(ValueError, match="D even"):
        key_smoothing_factors(torch.ones(3), 0.5)
    with pytest.raises(ValueError, match="negative"):
        key_smoothing_factors(-torch.ones(4), 0.5)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("ksm") / request.param, arch=request.param)


def _run(model, tokens, kv_dtype=None, block_size=4):
    """(logits float32 [T, V], the cache views) of one forward over a fresh cache."""
    num_blocks = -(-len(tokens) // block_size) + 1
    caches = allocate_kv_caches(model, num_blocks, block_size, **({} if kv_dtype is None else
                                                                   dict(dtype=kv_dtype, kv_scale="token_head")))
    ids, pos, meta = prepare_inputs([tokens], [0], [list(range(1, num_blocks))], block_size)
    model.reset_attention_state()
    with torch.no_grad():
        logits = model.compute_logits(model(ids, pos, caches, meta)).float()
    return logits, caches


def _written_keys(caches, n):
    """float64 per layer: the K a layer's pages read back, [n, Hk, D]."""
    out = []
    for key_cache, _, *scales in caches.views:
        k = key_cache[1:].reshape(-1, *key_cache.shape[2:])[:n].double()
        if scales:
            k = k * scales[0][1:].reshape(-1, key_cache.shape[2])[:n, :, None].double()
        out.append(k)
    return out


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_fold_matches_the_float64_smoothed_key_reference(tiny, fmt, monkeypatch):
    """Folded, a model writes ``K / m`` of the unfolded model's K (its "auto" pages times m equal the
    unfolded ones, and its logits, to float32 rounding), and its quantized pages read back times m
    equal the float64 reference ``smoothed_key_roundtrip`` of the keys it computed (one rounding step
    apart at most: the write divides in float32)."""
    tokens = TOKENS[0]
    model, _ = load_model(tiny)
    ref_logits, ref_caches = _run(model, tokens)
    keys = _written_keys(ref_caches, len(tokens))
    factors = smooth_model_keys(model, TOKENS, alpha=0.5)
    cfg = model.config
    assert factors.shape == (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    logits, caches = _run(model, tokens)
    assert torch.allclose(logits, ref_logits, rtol=1e-4, atol=1e-4 * float(ref_logits.abs().max()))
    for layer, (k, got) in enumerate(zip(keys, _written_keys(caches, len(tokens)))):
        assert torch.allclose(got * factors[layer].double(), k, rtol=1e-4, atol=1e-4 * float(k.abs().max())), layer
    written = []  # each layer's key argument of the write, in this quantized forward
    original = llama.StepAttention.reshape_and_cache
    monkeypatch.setattr(llama.StepAttention, "reshape_and_cache",
                        lambda self, key, *a: (written.append(key.detach().clone()), original(self, key, *a))[1])
    f = get_kv_cache_dtype(fmt)
    _, caches = _run(model, tokens, kv_dtype=f.storage_dtype)
    for layer, (k_in, got) in enumerate(zip(written, _written_keys(caches, len(tokens)))):
        m = factors[layer].double()
        k = k_in.double() * m  # the key in the unsmoothed model's units
        want = ref_quant.smoothed_key_roundtrip(k, factors[layer], f.max_value, f.storage_dtype)
        # one step of the row's grid in smoothed units (fp8: relative, 2^-3 of the magnitude, or the
        # subnormal step), times m back
        row = (k / m).abs().amax(-1, keepdim=True) / f.max_value
        step = row if fmt == "int8" else torch.maximum((k / m).abs() * 2 ** -3, row * 2 ** -9 * 448)
        assert bool(((got * m - want).abs() <= step * m * 1.001 + 1e-12).all()), layer


def test_smoothing_flattens_an_outlier_channel_pair():
    """The reason for the scheme: a key row whose one RoPE pair is 20x the rest loses the small
    channels to a per-token int8 scale; smoothed, their error in the float64 reference drops."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn((64, 1, 32), generator=gen, dtype=torch.float64)
    k[..., 3] *= 20
    k[..., 19] *= 20
    plain = ref_quant.smoothed_key_roundtrip(k, torch.ones(1, 32), 127.0, torch.int8)
    factors = key_smoothing_factors(k.abs().amax(0), 1.0)
    smoothed = ref_quant.smoothed_key_roundtrip(k, factors, 127.0, torch.int8)
    rest = torch.ones(32, dtype=torch.bool)
    rest[[3, 19]] = False  # the outlier pair keeps its error; every other channel's shrinks
    assert float((smoothed - k)[..., rest].norm()) < 0.25 * float((plain - k)[..., rest].norm())
    assert float((smoothed - k).norm()) < float((plain - k).norm())


def test_fold_refusals_change_nothing(tmp_path):
    path = build_tiny_model(tmp_path / "g3", arch="gemma3_text")
    model, _ = load_model(path)
    cfg = model.config
    before = [p.clone() for p in model.parameters()]
    good = torch.ones(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    with pytest.raises(ValueError, match="num_layers, num_kv_heads, head_dim"):
        fold_key_smoothing(model, good[:1])
    with pytest.raises(ValueError, match="finite and > 0"):
        fold_key_smoothing(model, good * 0)
    unpaired = good.clone()
    unpaired[..., 0] = 2.0
    with pytest.raises(ValueError, match="RoPE pair"):
        fold_key_smoothing(model, unpaired)
    if cfg.num_key_value_heads > 1:
        per_head = good.clone()
        per_head[:, 0] = 2.0
        with pytest.raises(ValueError, match="differ between KV heads"):
            fold_key_smoothing(model, per_head)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_calibrate_on_a_pipeline(tmp_path):
    path = build_tiny_model(tmp_path / "g3", arch="gemma3_text")
    with pytest.raises(ValueError, match="kv_cache_dtype='auto'"):
        calibrate_key_smoothing(Pipeline.from_pretrained(path), ["hello world"])
    pipe = Pipeline.from_pretrained(path, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="prompts is empty"):
        calibrate_key_smoothing(pipe, [])
    factors = calibrate_key_smoothing(pipe, ["The cache line was evicted", "A block table maps tokens"])
    assert torch.equal(pipe.model.kv_key_smoothing, factors)
    with pytest.raises(ValueError, match="already key-smoothed"):
        calibrate_key_smoothing(pipe, ["hello"])
    amax = measure_key_channel_amax(pipe.model, [pipe.tokenizer.encode("The cache line was evicted")])
    assert amax.shape == factors.shape


def test_smoothed_pages_are_read_alike_by_every_backend(tmp_path):
    """The C decode kernel and the prompt path ("sdpa") and the float64-capable references ("torch")
    read smoothed pages as any others: the same greedy tokens."""
    from servelab import SamplingParams

    path = build_tiny_model(tmp_path / "g3", arch="gemma3_text")
    prompts = ["The cache line was evicted", "A block table maps tokens to", "hello world, said the"]
    outs = []
    for backend in ("sdpa", "torch"):
        pipe = Pipeline.from_pretrained(path, kv_cache_dtype="int8", attention_backend=backend)
        calibrate_key_smoothing(pipe, prompts)
        outs.append([o.token_ids for o in pipe.generate(prompts, SamplingParams(temperature=0, max_tokens=8))])
    assert outs[0] == outs[1]
