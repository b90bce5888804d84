"""Packed CPU GEMMs (servelab.models.linear) against F.linear and a float64 reference."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.models import build_tiny_model, cpu_gemm, load_model
from servelab.models import linear as linear_module
from servelab.models.linear import Linear, linear, packing_unavailable_reason, set_weight_packing

from model_harness import error_bound

PACKS = packing_unavailable_reason(torch.float32, "cpu") is None
needs_packing = pytest.mark.skipif(not PACKS, reason=str(packing_unavailable_reason(torch.float32, "cpu")))


@pytest.fixture
def pack_every_size(monkeypatch):
    """Pack weights of any size for oneDNN, at every row count (the size threshold and the
    few-row kernel's rows are speed choices; the numerics under test are oneDNN's packed
    kernel's, the few-row kernel's are in test_cpu_gemm.py). Constant for every hypothesis example."""
    monkeypatch.setattr(linear_module, "MIN_PACKED_ELEMENTS", 0)
    monkeypatch.setattr(cpu_gemm, "MAX_ROWS", -1)


@needs_packing
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(0, 40), k=st.integers(1, 200), n=st.integers(1, 200), has_bias=st.booleans(),
       leading=st.sampled_from([(), (3,)]), scale=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_packed_linear_is_within_the_float32_bound_of_float64(pack_every_size, rows, k, n, has_bias, leading, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(k, n, bias=has_bias).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * scale)
        if has_bias:
            layer.bias.copy_(torch.randn(n, generator=gen))
    x = torch.randn(*leading, rows, k, generator=gen)
    got = layer(x)
    assert layer._packed_weight().key is not None, "the packed path did not run"
    reference = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    bound = error_bound(x, layer.weight, layer.bias)
    assert got.shape == (*leading, rows, n) and got.dtype == torch.float32
    assert ((got.double() - reference).abs() <= bound).all()
    plain = F.linear(x, layer.weight, layer.bias)  # the reference kernel meets the same bound
    assert ((plain.double() - reference).abs() <= bound).all()


@needs_packing
def test_a_weight_changed_in_place_or_replaced_is_repacked(pack_every_size):
    layer = Linear(32, 24, bias=False).requires_grad_(False)
    x = torch.randn(5, 32)
    first = layer(x)
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place: torch's version counter moves
    assert torch.allclose(layer(x), -2.0 * first, rtol=1e-5, atol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn(24, 32), requires_grad=False)  # new storage
    assert torch.allclose(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_refusals_name_the_reason_and_fall_back_to_f_linear_bit_for_bit():
    assert "float64" in packing_unavailable_reason(torch.float64, "cpu")
    assert "bfloat16" in packing_unavailable_reason(torch.bfloat16, "cpu")
    assert "meta" in packing_unavailable_reason(torch.float32, "meta")
    layer = Linear(16, 8, dtype=torch.float64).requires_grad_(False)
    x = torch.randn(3, 16, dtype=torch.float64)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer._packed_weight().key is None


def test_autograd_sees_the_plain_gemm():
    layer = Linear(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    assert layer._packed_weight().key is None  # a recorded GEMM never used the packed copy


@needs_packing
def test_set_weight_packing_switches_every_layer_and_the_lm_head(pack_every_size, tmp_path):
    model, config = load_model(build_tiny_model(tmp_path / "tiny", seed=0))
    hidden = torch.randn(4, config.hidden_size)
    packed_logits = model.compute_logits(hidden)
    assert model.__dict__["_lm_head_packed"].key is not None
    count = set_weight_packing(model, False)
    assert count == 4 * config.num_hidden_layers + (model.lm_head is not None)
    assert model.__dict__["_lm_head_packed"].key is None
    plain_logits = model.compute_logits(hidden)
    assert torch.equal(plain_logits, F.linear(hidden, model.lm_head_weight))
    torch.testing.assert_close(packed_logits, plain_logits, rtol=1e-5, atol=1e-5)
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features)
    assert torch.equal(layer(x), F.linear(x, layer.weight)) and layer._packed_weight().key is None
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters()} | set(
        dict(model.named_buffers()))  # no packed copy leaks into the state dict
    with pytest.raises(TypeError, match="enabled must be a bool"):
        set_weight_packing(model, "no")
    model2, _ = load_model(build_tiny_model(tmp_path / "tiny2", seed=0), pack_weights=False)
    assert not model2.pack_weights and not model2.model.layers[0].self_attn.qkv_proj.pack_weights


def test_linear_function_without_a_cache_is_f_linear():
    x, w, b = torch.randn(3, 5), torch.randn(7, 5), torch.randn(7)
    assert torch.equal(linear(x, w, b, None), F.linear(x, w, b))


@needs_packing
def test_rows_and_weight_size_pick_the_gemm():
    rows_max = cpu_gemm.MAX_ROWS
    small = Linear(64, 64, bias=False).requires_grad_(False)  # 4,096 elements
    many = torch.randn(rows_max + 1, 64)
    panels = cpu_gemm.usable(many) and cpu_gemm.preferred()
    got = small(many)  # many rows, small weight: never oneDNN; the panel kernel where preferred, else F.linear
    assert small._packed_weight().key is None and (small._packed_weight().panels_key is not None) == panels
    if not panels:
        assert torch.equal(got, F.linear(many, small.weight))
    big = Linear(512, 512, bias=False).requires_grad_(False)  # 2^18: oneDNN from MAX_ROWS + 1 rows
    big(torch.randn(rows_max + 1, 512))
    assert big._packed_weight().key is not None and big._packed_weight().panels_key is None
    if panels:  # few rows, any size: the few-row kernel
        big(torch.randn(1, 512))
        assert small._packed_weight().panels_key is not None and big._packed_weight().panels_key is not None
        assert small._packed_weight().key is None


@pytest.mark.parametrize("case", ["plain", "float64", "k_strided", "bias_strided", "x_records_grad"])
def test_the_few_row_route_takes_only_what_the_kernel_can(kernel_library, monkeypatch, case):
    """The few-row kernel's checks (linear._few_row_panels) refuse each input it cannot take, which
    then runs the general route with F.linear's result; a plain input takes it."""
    calls = []
    real = cpu_gemm._gemm
    monkeypatch.setattr(cpu_gemm, "_gemm", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(cpu_gemm, "preferred", lambda: True)  # the route on any build (the kernel computes
    dtype = torch.float64 if case == "float64" else torch.float32  # correctly everywhere)
    layer = Linear(48, 40, bias=True, dtype=dtype).requires_grad_(False)
    x = torch.randn(3, 96 if case == "k_strided" else 48, dtype=dtype)
    x = x[:, ::2] if case == "k_strided" else x
    if case == "bias_strided":
        layer.bias = torch.nn.Parameter(torch.randn(80)[::2], requires_grad=False)
    if case == "x_records_grad":
        x.requires_grad_(True)
    got = layer(x)
    assert calls == ([1] if case == "plain" else [])
    want = F.linear(x.detach().double(), layer.weight.double(), layer.bias.double())
    assert torch.allclose(got.detach().double(), want, atol=1e-5, rtol=1e-5)
    assert got.requires_grad == (case == "x_records_grad")


@needs_packing
def test_a_pipeline_generates_the_same_tokens_with_and_without_packing(pack_every_size, tmp_path):
    from servelab import Pipeline, SamplingParams

    path = build_tiny_model(tmp_path / "tiny", seed=3)
    prompts = [[1, 5, 9, 2], [7] * 20, list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for pack in (True, False):
        pipe = Pipeline.from_pretrained(path, pack_weights=pack)
        assert pipe.model.pack_weights is pack
        outputs[pack] = [o.token_ids for o in pipe.generate(prompts, params)]
    assert pipe.model.model.layers[0].mlp.gate_up_proj._packed_weight().key is None  # never packed when off
    assert outputs[True] == outputs[False]
    with pytest.raises(TypeError, match="pack_weights must be a bool"):
        Pipeline.from_pretrained(path, pack_weights=1)
