"""apply_token_bitmask: Triton kernel and CPU path held to the reference, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.reference.bitmask import apply_token_bitmask as reference_apply
from servelab.samplers.structured import apply_token_bitmask, bitmask_allows_nothing, unpack_bitmask


@st.composite
def bitmask_cases(draw):
    vocab = draw(st.sampled_from([1, 5, 31, 32, 33, 63, 64, 65, 100, 129]))
    num_tokens = draw(st.integers(1, 5))
    words = math.ceil(vocab / 32)
    masked_rows = draw(st.lists(st.integers(0, num_tokens - 1), unique=True, max_size=num_tokens))
    style = draw(st.sampled_from(["random", "all", "none", "one"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if style == "random":
        bitmask = torch.randint(-2**31, 2**31 - 1, (len(masked_rows), words), generator=gen, dtype=torch.int64)
        bitmask = bitmask.to(torch.int32)
    elif style == "all":
        bitmask = torch.full((len(masked_rows), words), -1, dtype=torch.int32)
    elif style == "none":
        bitmask = torch.zeros((len(masked_rows), words), dtype=torch.int32)
    else:  # exactly one allowed token per row, bit 31 included
        bitmask = torch.zeros((len(masked_rows), words), dtype=torch.int32)
        for r in range(len(masked_rows)):
            token = draw(st.integers(0, vocab - 1))
            bit = token % 32
            bitmask[r, token // 32] = -(1 << 31) if bit == 31 else 1 << bit
    logits = torch.randn(num_tokens, vocab, generator=gen, dtype=torch.float64)
    return logits, bitmask, masked_rows


@settings(max_examples=60)
@given(bitmask_cases())
def test_cpu_path_matches_reference(case):
    logits, bitmask, rows = case
    expected = reference_apply(logits.clone(), bitmask, rows)
    actual = apply_token_bitmask(logits.clone(), bitmask, rows, backend="torch")
    assert torch.equal(actual, expected)
    untouched = [r for r in range(logits.shape[0]) if r not in rows]
    assert torch.equal(actual[untouched], logits[untouched])  # rows without a mask are left alone


@pytest.mark.interpreter
@settings(max_examples=25)
@given(bitmask_cases())
def test_triton_matches_reference(case):
    logits, bitmask, rows = case
    logits = logits.float()
    expected = reference_apply(logits.clone(), bitmask, rows)
    actual = apply_token_bitmask(logits.clone(), bitmask, torch.tensor(rows, dtype=torch.int64), backend="triton")
    assert torch.equal(actual, expected)


def test_bit_31_and_vocab_not_divisible_by_32():
    logits = torch.zeros(1, 40)
    bitmask = torch.tensor([[-(1 << 31), 1 << 7]], dtype=torch.int32)  # tokens 31 and 39
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31, 39]
    assert unpack_bitmask(bitmask, 40).nonzero()[:, 1].tolist() == [31, 39]


def test_all_masked_rows_are_detected():
    bitmask = torch.tensor([[0, 0], [0, 1 << 3], [-1, -1]], dtype=torch.int32)
    # bit 3 of word 1 is token 35, outside a 35-token vocabulary: nothing allowed
    assert bitmask_allows_nothing(bitmask, 35).tolist() == [True, True, False]
    assert bitmask_allows_nothing(bitmask, 36).tolist() == [True, False, False]


@pytest.mark.parametrize("bad, match", [
    (dict(bitmask=torch.zeros(2, 3, dtype=torch.int32)), "needs ceil"),
    (dict(bitmask=torch.zeros(2, 2, dtype=torch.int64)), "int32"),
    (dict(indices=[0, 5]), r"\[0, 2\)"),
    (dict(indices=[1, 1]), "repeat"),
    (dict(indices=[0]), "entries"),
])
def test_bad_arguments_are_named(bad, match):
    args = dict(logits=torch.zeros(2, 40), bitmask=torch.zeros(2, 2, dtype=torch.int32), indices=None)
    args.update(bad)
    for fn in (reference_apply, lambda *a: apply_token_bitmask(*a, backend="torch")):
        with pytest.raises(ValueError, match=match):
            fn(args["logits"], args["bitmask"], args["indices"])
