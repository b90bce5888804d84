"""min-p / top-k / top-p sampling: reference vs the definition, Triton kernel vs reference, distribution."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from sampling_stats import assert_distributed_as

from servelab.kernels.sampling import top_k_top_p_sample as kernel_sample
from servelab.reference.sampling import top_k_top_p_keep_mask
from servelab.reference.sampling import top_k_top_p_sample as reference_sample
from servelab.samplers.backends import resolve_backend

pytestmark = pytest.mark.interpreter


def brute_force_keep(logits, top_k, top_p, min_p):
    """The definition, token by token in float64; also returns the smallest margin to a boundary."""
    keep_rows, margin = [], float("inf")
    for row in range(logits.shape[0]):
        values = logits[row].double()
        weights = torch.exp(values - values.max())
        keep = values > float("-inf")
        if min_p is not None and min_p[row] > 0:
            margin = min(margin, float((weights - float(min_p[row])).abs().min()))
            keep &= weights >= float(min_p[row])
        k = int(top_k[row]) if top_k is not None else 0
        if 0 < k < values.numel():
            masked = torch.where(keep, values, float("-inf"))
            keep &= values >= masked.sort(descending=True).values[k - 1]
        if top_p is not None and top_p[row] < 1:
            total = weights[keep].sum()
            above = torch.stack([weights[keep & (values > values[v])].sum() for v in range(values.numel())])
            finite = keep & (weights > 0)
            if bool(finite.any()):
                margin = min(margin, float(((above / total - float(top_p[row])).abs())[finite].min()))
            keep &= above < float(top_p[row]) * total
        keep_rows.append(keep)
    return torch.stack(keep_rows), margin


def random_case(seed, num_rows, vocab_size, ties=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 2
    if ties:
        logits = (logits * 2).round() / 2  # many equal values: boundary ties must all be kept
    if vocab_size > 2:
        logits[0, : vocab_size // 3] = float("-inf")  # masked tokens (allowed-ids, bad words)
    top_k = torch.randint(-1, vocab_size + 2, (num_rows,), generator=gen)
    top_p = torch.rand(num_rows, generator=gen).clamp(min=0.05)
    top_p[::3] = 1.0
    min_p = torch.rand(num_rows, generator=gen) * 0.2
    min_p[::2] = 0.0
    noise = torch.empty(num_rows, vocab_size).exponential_(generator=gen)
    return logits, top_k, top_p, min_p, noise


@settings(max_examples=25)
@given(seed=st.integers(0, 2**31), num_rows=st.integers(1, 6), vocab_size=st.integers(1, 60), ties=st.booleans())
def test_reference_keep_mask_matches_the_definition(seed, num_rows, vocab_size, ties):
    logits, top_k, top_p, min_p, _ = random_case(seed, num_rows, vocab_size, ties)
    expected, margin = brute_force_keep(logits, top_k, top_p, min_p)
    assume(margin > 1e-5)  # float32 vs float64 may cut differently right at a boundary
    assert torch.equal(top_k_top_p_keep_mask(logits, top_k, top_p, min_p), expected)


def boundary_revealing_noise(logits):
    """Noise that makes the kept token with the *smallest* logit win the race.

    score = weight / noise = 1 / rank with rank 1 for the smallest logit, so the
    sampled token exposes exactly where each implementation cut the row.
    """
    weights = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    rank = logits.argsort(dim=-1).argsort(dim=-1).float() + 1
    return torch.where(weights > 0, weights * rank, 1.0)


@settings(max_examples=20)
@given(seed=st.integers(0, 2**31), num_rows=st.integers(1, 5), vocab_size=st.sampled_from([1, 2, 7, 33, 300, 2500]),
       ties=st.booleans())
def test_kernel_matches_reference_on_random_inputs(seed, num_rows, vocab_size, ties):
    logits, top_k, top_p, min_p, noise = random_case(seed, num_rows, vocab_size, ties)
    for filters in [(top_k, top_p, min_p), (top_k, None, None), (None, top_p, None), (None, None, min_p)]:
        expected = reference_sample(logits, *filters, noise)
        assert torch.equal(kernel_sample(logits, *filters, noise), expected)
        cut_noise = boundary_revealing_noise(logits)
        assert torch.equal(kernel_sample(logits, *filters, cut_noise), reference_sample(logits, *filters, cut_noise))


def test_boundary_revealing_noise_exposes_the_cut():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 2.0]])
    noise = boundary_revealing_noise(logits)
    top_k = torch.tensor([2])
    # Top-2 by value keeps 3.0 and both 2.0s (ties kept): the lowest kept logit is a 2.0.
    for sample in (kernel_sample, reference_sample):
        assert sample(logits, top_k, None, None, noise).item() in (2, 4)
        assert sample(logits, None, None, None, noise).item() == 3  # nothing cut: the global minimum
        assert sample(logits, torch.tensor([1]), None, None, noise).item() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_kernel_matches_reference_for_dtypes_and_strided_rows(dtype):
    gen = torch.Generator().manual_seed(11)
    wide = (torch.randn(4, 2 * 257, generator=gen) * 3).to(dtype)
    logits = wide[:, ::2]  # a strided view: rows are not contiguous
    top_k = torch.tensor([5, -1, 300, 1])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.3])
    min_p = torch.tensor([0.0, 0.05, 0.2, 0.0])
    for noise in (torch.empty(4, 257).exponential_(generator=gen), boundary_revealing_noise(logits.float())):
        expected = reference_sample(logits, top_k, top_p, min_p, noise)
        assert torch.equal(kernel_sample(logits, top_k, top_p, min_p, noise), expected)


def test_rows_with_a_single_finite_logit_and_empty_batches():
    logits = torch.full((2, 9), float("-inf"))
    logits[0, 4] = -50.0
    logits[1, 8] = 7.0
    noise = torch.ones(2, 9)
    for sample in (kernel_sample, reference_sample):
        assert sample(logits, torch.tensor([3, 1]), torch.tensor([0.1, 0.1]), torch.tensor([0.5, 1.0]),
                      noise).tolist() == [4, 8]
        assert sample(torch.zeros(0, 9), None, None, None, torch.zeros(0, 9)).shape == (0,)


@pytest.mark.parametrize(
    ("filters", "kept"),
    [
        ({"top_k": 3}, 3),
        ({"top_p": 0.75}, 4),
        ({"min_p": 0.2}, 5),
        ({"top_k": 5, "top_p": 0.9, "min_p": 0.1}, 4),
    ],
)
def test_samples_only_from_the_kept_set_in_proportion(filters, kept):
    vocab_size, num_rows = 8, 80_000
    logits = torch.tensor([1.0, 2.2, -0.3, 1.7, 0.4, 2.0, -1.2, 0.9])
    batch = logits.expand(num_rows, -1)
    args = {name: torch.full((num_rows,), value) for name, value in filters.items()}
    gen = torch.Generator().manual_seed(2024)
    noise = torch.empty(num_rows, vocab_size).exponential_(generator=gen)
    sampled = reference_sample(batch, args.get("top_k"), args.get("top_p"), args.get("min_p"), noise)
    single = {name: value[:1] for name, value in args.items()}
    keep, margin = brute_force_keep(logits[None], single.get("top_k"), single.get("top_p"), single.get("min_p"))
    assert margin > 1e-3 and int(keep.sum()) == kept
    probs = torch.softmax(logits.double(), dim=-1)
    expected = torch.where(keep[0], probs, 0.0)
    # Power: keeping one more token (the most likely one cut) must be detected.
    extra = torch.where(keep[0], float("-inf"), logits).argmax()
    wrong = expected.clone()
    wrong[extra] = probs[extra]
    assert_distributed_as(sampled, expected / expected.sum(), wrong=wrong / wrong.sum(), label=str(filters))


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"logits": torch.zeros(3)}, ValueError, r"logits must have 2 dimension"),
        ({"logits": torch.zeros(2, 4, dtype=torch.int32)}, TypeError, r"logits must be a floating tensor"),
        ({"top_k": torch.tensor([1.0, 2.0])}, TypeError, r"top_k must be an integer tensor"),
        ({"top_k": torch.tensor([1, 2, 3])}, ValueError, r"top_k must have one entry per row \(2\)"),
        ({"top_p": torch.tensor([0.0, 1.0])}, ValueError, r"top_p holds 0.0; valid: \(0, 1\]"),
        ({"min_p": torch.tensor([0.1, 1.5])}, ValueError, r"min_p holds 1.5"),
        ({"exponential_noise": torch.ones(2, 5)}, ValueError, r"exponential_noise must match logits' shape"),
    ],
)
@pytest.mark.parametrize("sample", [kernel_sample, reference_sample])
def test_bad_inputs_are_refused_by_both_implementations(sample, kwargs, error, pattern):
    args = {"logits": torch.zeros(2, 4), "top_k": None, "top_p": None, "min_p": None,
            "exponential_noise": torch.ones(2, 4)}
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        sample(**args)


def test_triton_backend_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' cannot run on cpu: 0 active drivers"):
        resolve_backend("triton", "cpu")
    assert resolve_backend("auto", "cpu") == "torch"
