"""The C argmax (``servelab.samplers.cpu_argmax``) against ``torch.argmax`` and its finiteness rule."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.attention import cpu_decode, cpu_kernel_build
from servelab.samplers import Sampler, SamplingParams, cpu_argmax

SPECIALS = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0)


@pytest.fixture(scope="module")
def kernel():
    """The library loaded: skips only without a compiler."""
    if shutil.which(cpu_kernel_build.compiler()) is None:
        pytest.skip("no C compiler: torch's argmax runs")
    if cpu_decode.library() is None:
        pytest.fail("a C compiler exists but the CPU kernel library did not load")


def reference(logits: torch.Tensor) -> list[int] | None:
    """torch.argmax per row, or None when some row's maximum is not finite (a NaN anywhere in it,
    +inf, or a row of -inf): computed from the definition, not from the code under test."""
    for row in logits:
        if bool(row.isnan().any()) or not bool(torch.isfinite(row.max())):
            return None
    return logits.argmax(dim=-1).tolist()


@settings(max_examples=120, deadline=None)
@given(rows=st.integers(0, 6), n=st.integers(1, 300), extra=st.integers(0, 40), levels=st.sampled_from([0, 3, 1000]),
       specials=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 299), st.sampled_from(SPECIALS)), max_size=5),
       threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_c_argmax_equals_torch(kernel, rows, n, extra, levels, specials, threads, seed):
    """Rows are a slice of a wider tensor (``extra`` more columns); ``levels`` rounds the values
    to that many steps (0: all equal) so maxima repeat, inside and across the 64 lanes and in
    the tail past the last whole 64."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, n + extra, generator=gen)
    if levels == 0:
        wide.fill_(0.5)
    elif levels < 1000:
        wide = (wide * levels).round()
    for r, c, value in specials:
        if r < rows and c < n:
            wide[r, c] = value
    logits = wide[:, :n]
    assert cpu_argmax.usable(logits)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_argmax.finite_argmax(logits)
    finally:
        torch.set_num_threads(before)
    assert got == reference(logits)


def test_the_first_maximum_wins_at_a_real_vocabulary(kernel):
    """SmolLM2's vocabulary: maxima repeated in different lanes, the tail, and the very end."""
    logits = torch.randn(4, 49_152, generator=torch.Generator().manual_seed(0))
    logits[0, [70, 7, 49_151]] = 9.0  # lane 7 of the first 64 wins over lane 6 of the second
    logits[1, [49_151, 49_150]] = 9.0  # only the last 64 hold it
    logits[2, :] = float("-inf")
    logits[2, 12_345] = -3.0  # one finite value among -inf
    logits[3, [64 * 5 + 3, 64 * 5 + 2]] = 9.0  # the same vector, the lower lane first
    assert cpu_argmax.finite_argmax(logits) == [7, 49_150, 12_345, 64 * 5 + 2]
    logits[2, 12_345] = float("-inf")
    assert cpu_argmax.finite_argmax(logits) is None  # a row of -inf: not finite


def test_rows_it_cannot_read_take_torch(kernel):
    """float64, a column-strided row, autograd recording: torch's argmax, the same answer."""
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(dim=-1).tolist()
    for other in (logits.double(), logits.t().contiguous().t(), logits.clone().requires_grad_()):
        assert not cpu_argmax.usable(other)
        assert cpu_argmax.finite_argmax(other) == expected
    nan = logits.double()
    nan[1, 5] = float("nan")
    assert cpu_argmax.finite_argmax(nan) is None


def test_the_greedy_shortcut_reads_the_c_pass(kernel, monkeypatch):
    """Sampler.greedy_tokens asks finite_argmax (so a pipeline's greedy steps take the C pass)."""
    calls = []
    original = cpu_argmax.finite_argmax
    monkeypatch.setattr(cpu_argmax, "finite_argmax", lambda logits: calls.append(1) or original(logits))
    logits = torch.randn(2, 200, generator=torch.Generator().manual_seed(2))
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    assert Sampler().greedy_tokens(logits, [greedy, greedy]) == logits.argmax(dim=-1).tolist()
    assert calls == [1]


@pytest.mark.parametrize("bad, error, match", [
    ([[1.0, 2.0]], TypeError, "logits must be a tensor, got list"),
    (torch.zeros(3), ValueError, r"logits must be .*shape \(3,\)"),
    (torch.zeros(2, 0), ValueError, r"n >= 1.*shape \(2, 0\)"),
    (torch.zeros(2, 3, dtype=torch.int64), ValueError, "floating-point.*torch.int64"),
])
def test_bad_logits_are_refused_by_name(bad, error, match):
    with pytest.raises(error, match=match):
        cpu_argmax.finite_argmax(bad)
