"""Resolving ``quantization=``: shorthands, explicit fields, targets (exact, re:, fnmatch) against
HF module names of fused layers, ignore, and every refusal naming its field."""

from __future__ import annotations

import pytest

from servelab.quantization.spec import QuantizationConfigArgs, QuantSpec, parse_setting, resolve_plan

QKV = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
MODULES = [
    ("model.layers.0.self_attn.qkv_proj", QKV, 64),
    ("model.layers.0.self_attn.o_proj", ["model.layers.0.self_attn.o_proj"], 64),
    ("model.layers.1.mlp.down_proj", ["model.layers.1.mlp.down_proj"], 96),
    ("lm_head", ["lm_head"], 64),
]


def methods(plan):
    return dict(plan.layers)


def test_shorthands_and_defaults():
    assert parse_setting("w4a16") == QuantizationConfigArgs(linear=QuantSpec("w4a16", 128))
    assert parse_setting("w4a16-g32").linear == QuantSpec("w4a16", 32)
    assert parse_setting(None) is None and parse_setting("none") is None
    plan = resolve_plan("int8", MODULES)
    assert plan.source == "online" and methods(plan) == {
        "model.layers.0.self_attn.qkv_proj": "int8", "model.layers.0.self_attn.o_proj": "int8",
        "model.layers.1.mlp.down_proj": "int8", "lm_head": None}  # the head stays float by default
    assert plan.groups["model.layers.*.self_attn.qkv_proj"] == "int8" and plan.groups["lm_head"] == "float"
    assert resolve_plan("auto", MODULES).source == "none"  # a float checkpoint stays float


def test_targets_exact_regex_fnmatch_and_ignore():
    plan = resolve_plan({"method": "w4a16", "group_size": 32, "targets": ["re:.*_proj"], "ignore": ["down_proj"]},
                        MODULES)
    assert methods(plan)["model.layers.0.self_attn.qkv_proj"] == "w4a16"
    assert methods(plan)["model.layers.1.mlp.down_proj"] is None and plan.group_size == 32
    plan = resolve_plan({"linear": {"method": "int8"}, "targets": ["*.self_attn.*"], "ignore": []}, MODULES)
    assert [n for n, m in plan.layers if m] == ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"]
    plan = resolve_plan({"method": "q8_0", "targets": ["lm_head"]}, MODULES[:3] + [MODULES[3]], None)
    assert methods(plan)["lm_head"] is None  # ignore's default (lm_head) wins over a target


def test_checkpoint_formats_and_explicit_fields_win():
    stored = {"model.layers.0.self_attn.qkv_proj": "Q4_1", "model.layers.0.self_attn.o_proj": "Q4_1",
              "model.layers.1.mlp.down_proj": "Q6_K", "lm_head": "Q8_0"}
    plan = resolve_plan("auto", MODULES, stored)
    assert plan.source == "checkpoint" and methods(plan) == stored
    plan = resolve_plan({"ignore": ["lm_head", "re:.*down_proj"]}, MODULES, stored)
    assert methods(plan)["lm_head"] is None and methods(plan)["model.layers.1.mlp.down_proj"] is None
    assert methods(plan)["model.layers.0.self_attn.o_proj"] == "Q4_1"


@pytest.mark.parametrize("setting, checkpoint, message", [
    ("int9", None, "quantization method='int9' is unknown"),
    ({"method": "int8", "linear": {"method": "int8"}}, None, "'method' and 'linear' are mutually exclusive"),
    ({"method": "w4a16", "group_size": 40}, None, "group_size=40 does not divide .*qkv_proj's input width 64"),
    ({"method": "int8", "group_size": 32}, None, "group_size=32 does not apply to method 'int8'"),
    ({"method": "int8", "targets": ["re:.*nothing"]}, None, "targets entry 're:.*nothing' matches no linear layer"),
    ({"method": "int8", "ignore": ["gate_proj"]}, None, "ignore entry 'gate_proj' matches no linear layer"),
    ({"method": "int8", "targets": ["q_proj"]}, None, "matches part of the fused layer .*qkv_proj.* k_proj, v_proj"),
    ("int8", {"model.layers.0.self_attn.qkv_proj": "Q4_1"}, "'int8' contradicts the checkpoint, which stores Q4_1"),
    ({"method": "int8", "moe": "int8"}, None, "moe=.* this model has no expert"),
    ({"methd": "int8"}, None, r"unknown field\(s\) \['methd'\]"),
    ({"group_size": 32}, None, "'group_size' needs 'method'"),
])
def test_refusals_name_the_field(setting, checkpoint, message):
    with pytest.raises(ValueError, match=message):
        resolve_plan(setting, MODULES, checkpoint)


def test_non_string_targets_are_refused():
    with pytest.raises(ValueError, match="targets='re:.*' is invalid"):
        parse_setting({"method": "int8", "targets": "re:.*"})
    with pytest.raises(TypeError, match="quantization=3 is invalid"):
        parse_setting(3)
