"""The simulator's roofline on MoE models: GEMM FLOPs count the parameters a token activates (its
top-k experts, the shared expert, the router), weight bytes count the experts a step touches (the
expected number of distinct experts hit by T tokens' top-k picks), and dense models cost what they did."""

from __future__ import annotations

import pytest

from servelab.models import tiny_config
from servelab.scheduling.simulator.hardware import MODEL_PRESETS, ModelShape, roofline_cost_model


def test_dense_shapes_are_unchanged():
    dense = MODEL_PRESETS["llama-3.1-8b"]
    assert dense.active_linear_params == dense.linear_params
    assert dense.linear_params_read(1) == dense.linear_params_read(4096) == dense.linear_params


def test_mixtral_activates_two_of_eight_experts():
    mix = MODEL_PRESETS["mixtral-8x7b"]
    h, d, inter = 4096, 128, 14336
    attn = 32 * (h * 32 * d * 2 + h * 8 * d * 2)
    experts = 32 * 8 * 3 * h * inter
    assert mix.linear_params == attn + experts + 32 * 8 * h  # every expert and the router
    assert mix.active_linear_params == attn + 32 * (2 * 3 * h * inter + 8 * h)
    assert 12.5e9 < mix.active_linear_params < 13.0e9 < 45e9 < mix.linear_params  # ~12.9B active of ~46B
    one = mix.linear_params_read(1)  # a one-token step reads its two experts per layer
    assert one == mix.active_linear_params
    assert mix.linear_params_read(1) < mix.linear_params_read(4) < mix.linear_params_read(64) <= mix.linear_params
    assert mix.linear_params_read(4096) == pytest.approx(mix.linear_params, rel=1e-6)


def test_moe_decode_is_cheaper_than_its_dense_twin():
    mix = MODEL_PRESETS["mixtral-8x7b"]
    dense = ModelShape(32, 4096, 32, 8, 128, 8 * 14336, 32000, "bfloat16")  # same total parameters, all active
    moe_model = roofline_cost_model("H100-SXM", mix)
    dense_model = roofline_cost_model("H100-SXM", dense)
    assert moe_model.breakdown(1, 1024, 1)["gemm"] < 0.4 * dense_model.breakdown(1, 1024, 1)["gemm"]
    assert moe_model.breakdown(8192, 8192, 4, 8192)["gemm"] < 0.4 * dense_model.breakdown(8192, 8192, 4, 8192)["gemm"]


def test_from_config_reads_each_moe_family():
    q2 = ModelShape.from_config(tiny_config("qwen2_moe", num_hidden_layers=4, mlp_only_layers=[2],
                                            decoder_sparse_step=2))
    assert (q2.num_experts, q2.experts_per_token, q2.moe_intermediate_size) == (8, 4, 32)
    assert (q2.shared_expert_intermediate_size, q2.num_sparse_layers) == (96, 2)
    mix = ModelShape.from_config(tiny_config("mixtral"))
    assert (mix.num_experts, mix.experts_per_token, mix.moe_intermediate_size, mix.num_sparse_layers) == (8, 2, 128, 2)
    dense = ModelShape.from_config(tiny_config("llama"))
    assert dense.num_experts == 0 and dense.active_linear_params == dense.linear_params
    with pytest.raises(ValueError, match="experts_per_token=9"):
        ModelShape(2, 64, 4, 2, 16, 128, 512, num_experts=8, experts_per_token=9, moe_intermediate_size=32,
                   num_sparse_layers=2)
