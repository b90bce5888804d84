"""Native GGUF loading (quantization="auto"): a tiny checkpoint written as GGUF blocks (the
llama.cpp-style writer of tests/models/test_gguf.py) loads with its blocks kept, every weight equal
to the dequantized load's (q/k rows un-permuted by reordering blocks), greedy outputs equal; the tied
head reads the embedding's blocks; refusals name the tensor, the type or the field."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from servelab import Pipeline, SamplingParams
from servelab.models import build_tiny_model, load_model
from servelab.models.layer_api import dense_weight, linear_layers
from servelab.pipeline.sizing import model_weight_bytes
from servelab.quantization import cpu_kernels
from servelab.quantization.layer import QuantizedEmbedding, QuantizedLinear

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")
spec = importlib.util.spec_from_file_location("servelab_test_gguf_writer",
                                              Path(__file__).parents[1] / "models" / "test_gguf.py")
writer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(writer)

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = [[1, 5, 9, 2], [7, 7, 3], [4, 8, 15, 16, 23, 42], [11]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    out = {}
    for case, kind, tied in (("llama", "Q4_1", False), ("llama-tied", "Q8_0", True), ("qwen2", "Q4_0", False)):
        arch = case.split("-")[0]
        folder = build_tiny_model(root / case, arch=arch, seed=7, tie_word_embeddings=tied)
        out[case] = writer.write_gguf(folder, root / f"{case}.{kind}.gguf", arch=arch, qtype=kind)
    return out


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the kernels")
@pytest.mark.parametrize("case", ["llama", "llama-tied", "qwen2"])
def test_native_blocks_compute_the_dequantized_model(files, case, one_torch_thread):
    native, _ = load_model(files[case], quantization="auto")
    plain, _ = load_model(files[case])  # quantization=None: every tensor dequantized to float32
    layers = dict(linear_layers(plain))
    for name, layer in linear_layers(native):
        if name == "lm_head" and plain.lm_head is None:
            assert isinstance(layer, QuantizedLinear) and isinstance(native.model.embed_tokens, QuantizedEmbedding)
            assert layer.blocks.data_ptr() == native.model.embed_tokens.blocks.data_ptr()  # tied: one copy
            assert torch.equal(layer.dense_weight(), plain.model.embed_tokens.weight)
            continue
        assert isinstance(layer, QuantizedLinear), name
        assert torch.equal(layer.dense_weight(), dense_weight(layers[name])), name  # same bits, rows un-permuted
    assert model_weight_bytes(native) < 0.6 * model_weight_bytes(plain)
    got = Pipeline(native, num_blocks=64).generate(PROMPTS, GREEDY)
    want = Pipeline(plain, num_blocks=64).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_from_pretrained_shows_the_checkpoint_plan(files, one_torch_thread):
    pipe = Pipeline.from_pretrained(files["llama-tied"], num_blocks=32)
    plan = pipe.config.quantization
    assert plan.source == "checkpoint"
    assert plan.groups["model.layers.*.self_attn.qkv_proj"] == "Q8_0"
    assert plan.groups["lm_head"] == "Q8_0 (tied to model.embed_tokens)"
    float_pipe = Pipeline.from_pretrained(files["llama-tied"], quantization=None, num_blocks=32)
    assert not any(isinstance(m, QuantizedLinear) for m in float_pipe.model.modules())
    ignored = Pipeline.from_pretrained(files["llama"], quantization={"ignore": ["re:.*down_proj"]}, num_blocks=32)
    assert type(ignored.model.model.layers[0].mlp.down_proj).__name__ == "Linear"
    assert isinstance(ignored.model.model.layers[0].mlp.gate_up_proj, QuantizedLinear)


def test_refusals(files, tmp_path):
    with pytest.raises(ValueError, match="'int8' contradicts the checkpoint, which stores Q4_1"):
        load_model(files["llama"], quantization="int8")
    with pytest.raises(ValueError, match="targets entry 'nothing' matches no linear layer"):
        load_model(files["llama"], quantization={"targets": ["nothing"]})
    folder = build_tiny_model(tmp_path / "raw", arch="llama", seed=1)
    odd = writer.write_gguf(folder, tmp_path / "odd.gguf", raw_types={"blk.0.ffn_down.weight": "Q5_1"})
    with pytest.raises(ValueError, match=r"'blk.0.ffn_down.weight' .* stored as Q5_1, which servelab has no kernel"):
        load_model(odd, quantization="auto")
