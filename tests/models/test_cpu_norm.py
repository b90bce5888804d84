"""The C RMSNorm (``servelab.models.cpu_norm``) against ``torch.rms_norm``, its reference, bit for bit."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.attention import cpu_decode
from servelab.models import cpu_norm
from servelab.models.layers import RMSNorm

from probed_kernel_harness import floats, kernel_fixture, unchecked_fixture

kernel = kernel_fixture(cpu_norm, "RMSNorm", "RMSNorm runs torch.rms_norm (tests/models/test_layers.py)")
unchecked = unchecked_fixture(cpu_norm)


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(0, 70),
       hidden=st.one_of(st.integers(8, 80), st.integers(81, 3000), st.sampled_from([256, 576, 8192 + 37]),
                        st.integers(8192, 17000)),
       scale=st.sampled_from([1e-3, 1.0, 50.0, 1e4]), eps=st.sampled_from([1e-5, 1e-6, 1e-12]),
       threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_c_norm_equals_torch_rms_norm_bit_for_bit(kernel, rows, hidden, scale, eps, threads, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen) * scale
    weight = torch.randn(hidden, generator=gen)
    expected = torch.rms_norm(x, (hidden,), weight, eps)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # rows are split over threads from rows * hidden >= 32768 on
    try:
        got = cpu_norm.rms_norm(x, weight, eps)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, expected)


def test_the_module_takes_the_c_path_only_where_it_may(kernel, monkeypatch):
    norm = RMSNorm(64, 1e-6)
    calls = []
    real = cpu_norm._rms_norm
    monkeypatch.setattr(cpu_norm, "_rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(3, 64)
    with torch.no_grad():
        norm(x)
        norm(x.double())                      # float64: torch
        norm(torch.randn(64, 3).t())          # not contiguous: torch
        RMSNorm(4, 1e-6)(torch.randn(2, 4))   # hidden < 8: torch
    assert len(calls) == 1
    y = norm(x.requires_grad_())              # autograd records: torch, and gradients flow
    y.sum().backward()
    assert len(calls) == 1 and x.grad is not None and norm.weight.grad is not None


class OneUlpOff:
    """A stand-in library whose norm is torch's but for the last element, one ulp up."""

    @staticmethod
    def servelab_rms_norm(x, weight, out, rows, n, eps, threads):
        result = floats(out, rows * n).view(rows, n)
        result.copy_(torch.rms_norm(floats(x, rows * n).view(rows, n), (n,), floats(weight, n), eps))
        result[-1, -1] = torch.nextafter(result[-1, -1], torch.tensor(float("inf")))


def test_a_kernel_that_sums_in_another_order_is_never_used(unchecked, monkeypatch):
    """The once-per-process probe compares with torch.rms_norm; one differing bit keeps torch."""
    monkeypatch.setattr(cpu_decode, "library", lambda: OneUlpOff)
    reason = cpu_norm.unavailable_reason()
    assert reason is not None and "differs from torch.rms_norm on [1, 8]" in reason, reason
    x = torch.randn(2, 64)
    assert not cpu_norm.available() and not cpu_norm.usable(x, torch.ones(64))
    with torch.no_grad():
        assert torch.equal(RMSNorm(64, 1e-6)(x), torch.rms_norm(x, (64,), torch.ones(64), 1e-6))


def test_bad_input_is_refused_naming_the_argument(kernel):
    x, weight = torch.randn(2, 64), torch.randn(64)
    with pytest.raises(TypeError, match="x and weight must be tensors"):
        cpu_norm.rms_norm([1.0] * 64, weight, 1e-6)
    with pytest.raises(ValueError, match="eps=-1.0"):
        cpu_norm.rms_norm(x, weight, -1.0)
    for bad_x, bad_weight in ((x.double(), weight), (x, torch.randn(32)), (torch.randn(64, 2).t(), torch.randn(2)),
                              (torch.randn(2, 4), torch.randn(4))):
        with pytest.raises(ValueError, match=r"x \(shape"):
            cpu_norm.rms_norm(bad_x, bad_weight, 1e-6)
