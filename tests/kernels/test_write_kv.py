"""The default KV write's C path (attention.ops, servelab_write_kv) against the reference write."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.attention import cpu_kernel_build, ops
from servelab.reference import reshape_and_cache as reference_write


@pytest.fixture(scope="module")
def library():
    if shutil.which(cpu_kernel_build.compiler()) is None:
        pytest.skip("no C compiler: the torch write runs")
    assert ops._library() is not None


@st.composite
def float32_writes(draw):
    """A decode-like write: float32, contiguous caches, key/value rows strided like slices of a
    fused QKV output, distinct slots, sometimes padding (-1) rows."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    num_blocks = draw(st.integers(1, 6))
    kv_heads, head_size = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([4, 16, 64]))
    num_slots = num_blocks * block_size
    n = draw(st.integers(1, min(10, num_slots)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    slots = torch.randperm(num_slots, generator=gen)[:n]
    if draw(st.booleans()):
        slots[draw(st.integers(0, n - 1))] = -1
    gap = draw(st.integers(0, 3)) * head_size  # extra elements per row: strided rows
    wide = torch.randn(n, 2 * kv_heads * head_size + gap, generator=gen)
    key = wide[:, : kv_heads * head_size].view(n, kv_heads, head_size)
    value = wide[:, kv_heads * head_size: 2 * kv_heads * head_size].view(n, kv_heads, head_size)
    return key, value, slots.to(draw(st.sampled_from([torch.int32, torch.int64]))), (num_blocks, block_size,
                                                                                     kv_heads, head_size)


@settings(max_examples=60, deadline=None)
@given(problem=float32_writes())
def test_the_c_write_equals_the_reference(library, problem):
    key, value, slots, shape = problem
    caches = [torch.randn(*shape) for _ in range(2)]
    caches += [c.clone() for c in caches]
    ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    reference_write(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("case", ["plain", "padding", "float16", "strided_heads", "cache_view", "no_library"])
def test_the_c_write_takes_only_what_it_can(library, monkeypatch, case):
    written = []
    real = ops._write_in_c
    monkeypatch.setattr(ops, "_write_in_c", lambda *a: written.append(real(*a)) or written[-1])
    dtype = torch.float16 if case == "float16" else torch.float32
    key, value = torch.randn(3, 2, 8, dtype=dtype), torch.randn(3, 2, 8, dtype=dtype)
    if case == "strided_heads":  # heads not D apart: the C write reads rows of Hk * D contiguous elements
        key = torch.randn(3, 2, 16, dtype=dtype)[:, :, :8]
    caches = [torch.randn(4, 4, 2, 8, dtype=dtype) for _ in range(2)]
    if case == "cache_view":  # a cache that is not contiguous (every other block of a larger one)
        caches[0] = torch.randn(8, 4, 2, 8)[::2]
    caches += [c.clone() for c in caches]
    slots = torch.tensor([5, -1, 9] if case == "padding" else [5, 0, 9])
    if case == "no_library":
        monkeypatch.setattr(ops, "_library", lambda: None)
    ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    reference_write(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert written == ([True] if case == "plain" else [] if case == "padding" else [False])


def test_a_slot_past_the_cache_is_never_written_in_c(library):
    """The bound comes from prepare_slots: out of range, the torch write runs (and refuses)."""
    key = value = torch.randn(2, 1, 4)
    cache = torch.zeros(2, 4, 1, 4)
    slots, rows, top = ops.prepare_slots(torch.tensor([1, 8]))
    assert top == 8 and rows is None
    with pytest.raises(IndexError):
        ops.write_prepared(key, value, cache, cache.clone(), slots, rows, top)
