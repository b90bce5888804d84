"""The C SiLU (``servelab.models.cpu_silu``) against torch's ``F.silu``, its reference, bit for bit."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.attention import cpu_decode
from servelab.models import cpu_silu

from probed_kernel_harness import floats, kernel_fixture, unchecked_fixture

kernel = kernel_fixture(cpu_silu, "SiLU", "the glue calls torch's SiLU")
unchecked = unchecked_fixture(cpu_silu)


def torch_silu_by_rows(x: torch.Tensor) -> torch.Tensor:
    """The reference: ``F.silu`` on each row of ``x`` alone (under torch's grain, so never split)."""
    return torch.stack([torch.nn.functional.silu(row) for row in x]) if len(x) else x.clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(0, 40), n=st.one_of(st.integers(1, 80), st.integers(81, 800), st.sampled_from([1536, 8192])),
       gap=st.sampled_from([0, 1, 17]), scale=st.sampled_from([1e-3, 1.0, 8.0, 60.0, 1e4]),
       threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_c_silu_equals_torch_silu_bit_for_bit(kernel, rows, n, gap, scale, threads, seed):
    """Random rows of every tail length, as views with a row stride (the glue's gate is one), at 1-3 threads."""
    if rows * n >= cpu_silu.TORCH_GRAIN:
        rows = (cpu_silu.TORCH_GRAIN - 1) // n
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, n + gap, generator=gen) * scale
    x = base[:, :n]
    expected = torch.nn.functional.silu(x)  # one op, as the unfused layer calls it
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert cpu_silu.silu_(x) is x
    finally:
        torch.set_num_threads(before)
    assert same_bits(x, expected)


def test_evenly_spaced_bit_patterns_and_the_edges(kernel):
    """Every 4099th float32 bit pattern (every sign, exponent and NaN kind; ~1M values), in rows of 8,000
    (whole vectors: the tails are the probe's and the hypothesis test's), then 0, subnormals, the exp's
    over- and underflow edges, infinities.
    ``SERVELAB_SILU_EXHAUSTIVE=1`` compares all 2^32 patterns instead (~4 minutes on 2 cores)."""
    stride = 1 if os.environ.get("SERVELAB_SILU_EXHAUSTIVE") == "1" else 4099
    chunk = 8000 * 512
    for start in range(0, 1 << 32, chunk * stride):
        bits = torch.arange(start, min(start + chunk * stride, 1 << 32), stride, dtype=torch.int64)
        bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
        values = torch.cat([bits, torch.zeros(-len(bits) % 8000, dtype=torch.int32)]).view(torch.float32)
        x = values.view(-1, 8000)
        expected = torch_silu_by_rows(x)
        cpu_silu.silu_(x[:4])  # one call per <= TORCH_GRAIN elements
        for first in range(4, len(x), 4):
            cpu_silu.silu_(x[first:first + 4])
        assert same_bits(x, expected), f"bit patterns from {start:#x}"
    edges = cpu_silu._probe_values()[-40:].reshape(4, 10)
    expected = torch_silu_by_rows(edges)
    assert same_bits(cpu_silu.silu_(edges), expected)


class OneUlpOff:
    """A stand-in library whose SiLU is torch's but one ulp up wherever x > 80 (a few probe values)."""

    @staticmethod
    def servelab_silu_step():
        return 16

    @staticmethod
    def servelab_silu_rows(x, rows, n, stride, threads):
        view = floats(x, (rows - 1) * stride + n).as_strided((rows, n), (stride, 1))
        wrong = torch_silu_by_rows(view)
        wrong = torch.where(wrong > 80, torch.nextafter(wrong, torch.tensor(float("inf"))), wrong)
        view.copy_(wrong)


def test_a_kernel_whose_exp_differs_is_never_used(unchecked, monkeypatch):
    """The once-per-process probe compares with torch's SiLU; one differing bit keeps torch's."""
    monkeypatch.setattr(cpu_decode, "library", lambda: OneUlpOff)
    assert not cpu_silu.available() and not cpu_silu.usable(2, 8)
    assert "differs from torch's silu" in cpu_silu.unavailable_reason()
    with pytest.raises(ValueError, match="unavailable"):
        cpu_silu.silu_(torch.ones(2, 8))


def test_a_build_whose_vectors_are_not_torchs_is_never_used(kernel, unchecked, monkeypatch):
    """torch running another vector width walks a row's tail another way: refused before any value."""
    built = cpu_decode.library().servelab_silu_step()
    other = next(name for name, step in cpu_silu.TORCH_STEPS.items() if step != built)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    assert not cpu_silu.available()
    assert f"torch runs its {other} kernel" in cpu_silu.unavailable_reason()


def test_shapes_torch_may_split_are_refused(kernel):
    assert cpu_silu.usable(16, 1536) and cpu_silu.usable(1, cpu_silu.TORCH_GRAIN - 1)
    assert not cpu_silu.usable(32, 1536) and not cpu_silu.usable(1, cpu_silu.TORCH_GRAIN)
    with pytest.raises(ValueError, match=r"rows \* n >= 32768"):
        cpu_silu.silu_(torch.ones(32, 1536))


@pytest.mark.parametrize("x, error, match", [
    ([1.0], TypeError, "x must be a torch.Tensor, got list"),
    (torch.ones(2, 8, dtype=torch.float64), ValueError, "float32 CPU .* torch.float64"),
    (torch.ones(8), ValueError, r"\[rows, n\] .* \(8,\)"),
    (torch.ones(8, 2).t(), ValueError, r"strides \(1, 2\)"),
])
def test_bad_input_names_the_argument(x, error, match):
    with pytest.raises(error, match=match):
        cpu_silu.silu_(x)


def test_a_tensor_that_records_gradients_is_refused():
    with pytest.raises(ValueError, match="requires grad"):
        cpu_silu.silu_(torch.ones(2, 8, requires_grad=True))
