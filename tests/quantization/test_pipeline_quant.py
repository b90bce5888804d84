"""Online quantization in the pipeline (the MODEL_STEPS hook) on the tiny model: greedy outputs equal
to a float model holding the dequantized weights (the kernels differ only in accumulation order),
``pipe.config`` shows the resolved plan, and the KV pool is sized on the quantized bytes."""

from __future__ import annotations

import pytest
import torch

from servelab import Pipeline, SamplingParams
from servelab.models import build_tiny_model, load_model
from servelab.models.layer_api import linear_layers
from servelab.pipeline.sizing import model_weight_bytes
from servelab.quantization import QuantizationPlan, cpu_kernels
from servelab.quantization.layer import QuantizedLinear

PROMPTS = [[1, 5, 9, 2], [7, 7, 3], [4, 8, 15, 16, 23, 42], [11]]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("q") / "tiny")


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the kernels")
@pytest.mark.parametrize("setting", ["int8", "w4a16-g32", {"method": "q4_1", "ignore": ["re:.*down_proj"]}])
def test_quantized_greedy_equals_float_model_with_dequantized_weights(tiny, setting, one_torch_thread):
    pipe = Pipeline.from_pretrained(tiny, quantization=setting, num_blocks=64)
    plan = pipe.config.quantization
    assert isinstance(plan, QuantizationPlan) and plan.source == "online"
    quantized = dict(linear_layers(pipe.model))
    assert any(isinstance(layer, QuantizedLinear) for layer in quantized.values())
    float_model, _ = load_model(tiny)
    with torch.no_grad():
        for name, layer in linear_layers(float_model):
            if isinstance(quantized[name], QuantizedLinear):
                layer.weight.copy_(quantized[name].dense_weight())
    twin = Pipeline(float_model, num_blocks=64)
    got = [o.token_ids for o in pipe.generate(PROMPTS, GREEDY)]
    want = [o.token_ids for o in twin.generate(PROMPTS, GREEDY)]
    assert got == want


def test_plan_is_shown_and_memory_counts_quantized_bytes(tiny, one_torch_thread):
    plain = Pipeline.from_pretrained(tiny, num_blocks=64)
    pipe = Pipeline.from_pretrained(tiny, quantization="int8", num_blocks=64)
    assert "'model.layers.*.self_attn.qkv_proj': 'int8'" in repr(pipe.config)
    layers = [layer for _, layer in linear_layers(pipe.model) if isinstance(layer, QuantizedLinear)]
    saved = sum(layer.out_features * layer.in_features * 3 - layer.out_features * 4 for layer in layers)
    assert layers and model_weight_bytes(plain.model) - model_weight_bytes(pipe.model) == saved
    assert plain.config.quantization == "auto"  # a float folder stays float


def test_refusals_leave_the_model_unchanged(tiny):
    model, _ = load_model(tiny)
    with pytest.raises(ValueError, match="targets entry 'nothing' matches no linear layer"):
        Pipeline(model, quantization={"method": "int8", "targets": ["nothing"]})
    assert not any(isinstance(layer, QuantizedLinear) for _, layer in linear_layers(model))
    with pytest.raises(ValueError, match="group_size=48 does not divide"):
        Pipeline(model, quantization={"method": "w4a16", "group_size": 48})
