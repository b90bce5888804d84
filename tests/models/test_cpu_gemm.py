"""The few-row C GEMM (``servelab.models.cpu_gemm``) against a float64 reference, and its routing."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.attention import cpu_decode
from servelab.models import build_tiny_model, cpu_gemm
from servelab.models.linear import Linear

from model_harness import error_bound


@pytest.fixture(scope="module")
def kernel(kernel_library):
    """The library loaded (conftest's ``kernel_library``)."""


def with_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(0, 40), k=st.integers(0, 300), n=st.integers(1, 300), has_bias=st.booleans(),
       row_gap=st.integers(0, 9), threads=st.sampled_from([1, 2, 3]), scale=st.sampled_from([1e-3, 1.0, 30.0]),
       seed=st.integers(0, 2**16))
def test_gemm_is_within_the_float32_bound_of_float64(kernel, rows, k, n, has_bias, row_gap, threads, scale, seed):
    """Row blocks of 4 and their tails, partial panels, K not a multiple of the vector width,
    strided rows (a slice of a wider tensor), 1-3 threads."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * scale
    bias = torch.randn(n, generator=gen) if has_bias else None
    x = (torch.randn(rows, k + row_gap, generator=gen) * scale)[:, :k]
    got = with_threads(threads, lambda: cpu_gemm.gemm(x, cpu_gemm.pack(weight), bias, n))
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == (rows, n) and got.dtype == torch.float32 and got.is_contiguous()
    assert ((got.double() - reference).abs() <= error_bound(x, weight, bias)).all()


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 24), k=st.integers(1, 200), n=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_thread_count(kernel, rows, k, n, seed):
    gen = torch.Generator().manual_seed(seed)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    panels = cpu_gemm.pack(weight)
    batch = cpu_gemm.gemm(x, panels, None, n)
    for threads in (1, 2, 3):
        assert torch.equal(with_threads(threads, lambda: cpu_gemm.gemm(x, panels, None, n)), batch)
    for row in (0, rows - 1):
        assert torch.equal(cpu_gemm.gemm(x[row:row + 1], panels, None, n), batch[row:row + 1])


def test_pack_lays_out_panels_of_64_columns_zero_padded():
    weight = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    panels = cpu_gemm.pack(weight)
    assert panels.shape == (2, 3, 64) and panels.is_contiguous()
    assert torch.equal(panels[0], weight[:64].T) and torch.equal(panels[1, :, :6], weight[64:].T)
    assert not panels[1, :, 6:].any()


def test_bad_arguments_name_themselves(kernel):
    weight, x = torch.randn(10, 8), torch.randn(3, 8)
    panels = cpu_gemm.pack(weight)
    with pytest.raises(TypeError, match="weight must be a tensor"):
        cpu_gemm.pack([[1.0]])
    with pytest.raises(ValueError, match="weight .* must be a 2-D float32 CPU tensor"):
        cpu_gemm.pack(weight.double())
    with pytest.raises(TypeError, match="x must be a tensor"):
        cpu_gemm.gemm(x.tolist(), panels, None, 10)
    with pytest.raises(TypeError, match="bias must be a tensor or None"):
        cpu_gemm.gemm(x, panels, 1.0, 10)
    with pytest.raises(ValueError, match="out_features must be a positive int"):
        cpu_gemm.gemm(x, panels, None, 0)
    with pytest.raises(ValueError, match=r"x \(shape \(3, 8\), strides \(1, 3\)"):
        cpu_gemm.gemm(x.T.contiguous().T, panels, None, 10)  # K not contiguous
    with pytest.raises(ValueError, match="panels .* must be pack"):
        cpu_gemm.gemm(x, panels, None, 65)  # panels of a [10, 8] weight read as [65, 8]
    with pytest.raises(ValueError, match="panels .* must be pack"):
        cpu_gemm.gemm(torch.randn(3, 9), panels, None, 10)
    with pytest.raises(ValueError, match=r"bias \(shape \(9,\)"):
        cpu_gemm.gemm(x, panels, torch.randn(9), 10)


def test_linear_takes_the_kernel_for_few_rows_only_and_repacks_a_changed_weight(kernel, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "preferred", lambda: True)  # the routing, on any build
    layer = Linear(40, 70).requires_grad_(False)
    few, many = torch.randn(cpu_gemm.MAX_ROWS, 40), torch.randn(cpu_gemm.MAX_ROWS + 1, 40)
    cache = layer._packed_weight()
    assert torch.equal(layer(few), cpu_gemm.gemm(few, cpu_gemm.pack(layer.weight), layer.bias, 70))
    assert cache.panels_key is not None
    assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))  # a small weight, many rows
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place: the version counter moves, the panels are remade
    torch.testing.assert_close(layer(few), F.linear(few, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 40, requires_grad=True)
    with torch.enable_grad():
        layer.requires_grad_(True)(x).sum().backward()  # autograd sees F.linear
    assert x.grad is not None


def test_a_pipeline_generates_the_same_tokens_with_and_without_the_kernel(kernel, tmp_path, monkeypatch):
    from servelab import Pipeline, SamplingParams

    monkeypatch.setattr(cpu_gemm, "preferred", lambda: True)  # the kernel runs on any build
    path = build_tiny_model(tmp_path / "tiny", seed=3)
    prompts = [[1, 5, 9, 2], [7] * 20, list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs, kernel_rows = {}, cpu_gemm.MAX_ROWS
    for rows in (kernel_rows, -1):
        monkeypatch.setattr(cpu_gemm, "MAX_ROWS", rows)
        pipe = Pipeline.from_pretrained(path)
        outputs[rows] = [o.token_ids for o in pipe.generate(prompts, params)]
        used = pipe.model.model.layers[0].mlp.down_proj._packed_weight().panels_key is not None
        assert used is (rows > 0)
    assert outputs[kernel_rows] == outputs[-1]


def test_without_the_library_linear_keeps_f_linear_and_gemm_refuses(monkeypatch):
    """SERVELAB_CPU_KERNELS=0, no compiler, or a failed build: the same layer runs F.linear
    (a small weight) bit for bit, and the public gemm names the reason it refuses."""
    unavailable = cpu_decode.LibraryOnce()
    unavailable.checked = True  # looked up, and None
    monkeypatch.setattr(cpu_gemm, "_library", unavailable)
    layer = Linear(40, 70).requires_grad_(False)
    x = torch.randn(3, 40)
    assert not cpu_gemm.usable(x)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer._packed_weight().panels_key is None
    with pytest.raises(ValueError, match="kernel library built"):
        cpu_gemm.gemm(x, cpu_gemm.pack(layer.weight), None, 70)


def test_a_bias_that_autograd_records_keeps_f_linear(kernel):
    layer = Linear(8, 4)
    layer.weight.requires_grad_(False)
    layer(torch.randn(2, 8)).sum().backward()  # only the bias needs a gradient
    assert layer.bias.grad is not None and layer._packed_weight().panels_key is None


def test_the_route_is_preferred_only_on_builds_with_16_float_vectors(kernel, monkeypatch):
    assert cpu_gemm.preferred() is bool(cpu_gemm._library.lib.servelab_panel_gemm_preferred())
    monkeypatch.setattr(cpu_gemm, "preferred", lambda: False)  # e.g. an AVX2 build: oneDNN / F.linear
    layer = Linear(40, 70).requires_grad_(False)
    x = torch.randn(3, 40)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer._packed_weight().panels_key is None
