"""The shipped SmolLM2-135M Q4_1 file, loaded natively (Q4_1 blocks, Q8_0 tied embedding/head): greedy
outputs equal to the dequantized float32 path's, the plan shown, weights several times smaller.
Runs when the file is cached (``servelab.models.hub.fetch_smollm2_gguf``) or
``SERVELAB_FETCH_REAL_CHECKPOINT=1`` (CI; a failed fetch is then an error)."""

from __future__ import annotations

import os

import pytest

from servelab import Pipeline, SamplingParams
from servelab.models import hub
from servelab.pipeline.sizing import model_weight_bytes
from servelab.quantization import cpu_kernels

FETCH_ENV = "SERVELAB_FETCH_REAL_CHECKPOINT"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.",
           "The three laws of robotics are"]


@pytest.fixture(scope="module")
def smollm2_gguf():
    cached = hub.cache_root() / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not cached.is_file() and os.environ.get(FETCH_ENV) != "1":
        pytest.skip(f"set {FETCH_ENV}=1 to fetch SmolLM2-135M's Q4_1 GGUF (93 MB)")
    pytest.importorskip("gguf")
    return hub.fetch_smollm2_gguf()


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the kernels")
def test_smollm2_q4_1_native_matches_the_dequantized_path(smollm2_gguf, one_torch_thread):
    native = Pipeline.from_pretrained(smollm2_gguf, num_blocks=64)
    groups = native.config.quantization.groups
    assert groups["model.layers.*.mlp.gate_up_proj"] == "Q4_1" and groups["model.embed_tokens"] == "Q8_0"
    dense = Pipeline.from_pretrained(smollm2_gguf, quantization=None, num_blocks=64)
    assert model_weight_bytes(native.model) < 0.25 * model_weight_bytes(dense.model)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    got = [o.token_ids for o in native.generate(PROMPTS, greedy)]
    want = [o.token_ids for o in dense.generate(PROMPTS, greedy)]
    assert sum(a == b for a, b in zip(got, want)) >= len(PROMPTS) - 1


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the kernels")
def test_gemma3_q4_k_m_native_matches_the_dequantized_path(one_torch_thread):
    """Gemma 3 270M Q4_K_M (Q5_0 / Q4_K / Q6_K / Q8_0 blocks, mixed fused q|k|v): runs with
    ``SERVELAB_QUANT_GEMMA3=1`` (two loads of a 262k-vocabulary model: kept out of CI's budget)."""
    if os.environ.get("SERVELAB_QUANT_GEMMA3") != "1":
        pytest.skip("set SERVELAB_QUANT_GEMMA3=1 to test Gemma 3 Q4_K_M natively (fetches ~240 MB once)")
    pytest.importorskip("gguf")
    cached = hub.fetch_gemma3_270m_gguf()
    native = Pipeline.from_pretrained(cached, num_blocks=64)
    groups = native.config.quantization.groups
    assert "Q4_K" in groups["model.layers.*.self_attn.o_proj"] and "Q6_K" in groups["model.layers.*.mlp.down_proj"]
    dense = Pipeline.from_pretrained(cached, quantization=None, num_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    got = [o.token_ids for o in native.generate(PROMPTS, greedy)]
    want = [o.token_ids for o in dense.generate(PROMPTS, greedy)]
    assert sum(a == b for a, b in zip(got, want)) >= len(PROMPTS) - 1
