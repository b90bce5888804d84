"""Every LoRA kernel (the CPU fast path "torch", Triton under the interpreter) against the
per-row float64 reference (servelab.reference.lora), on random shapes: rows without an
adapter (-1), slice offsets into a wider output, segments of mixed lengths, add or overwrite."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.lora import available_lora_kernels, get_lora_kernel, register_lora_kernel
from servelab.lora.kernels import LoRAMapping
from servelab.reference import lora as ref

KERNELS = ["torch", "torch-dense", "triton"]


@contextlib.contextmanager
def kernel_named(name):
    """The kernel; "torch" runs its grouped GEMMs only, "torch-dense" its one-GEMM-over-all-slots form only."""
    from servelab.lora import ops
    saved = ops.DENSE_MIN_GROUPS, ops.DENSE_MAX_ELEMENTS
    if name.startswith("torch"):
        ops.DENSE_MIN_GROUPS, ops.DENSE_MAX_ELEMENTS = (1, 1 << 40) if name == "torch-dense" else (1 << 40, 0)
    try:
        yield get_lora_kernel(name.split("-")[0])
    finally:
        ops.DENSE_MIN_GROUPS, ops.DENSE_MAX_ELEMENTS = saved


@st.composite
def problems(draw):
    num_slots = draw(st.integers(1, 4))
    seg_lens = draw(st.lists(st.integers(0, 5), min_size=1, max_size=5))
    seg_slots = [draw(st.integers(-1, num_slots - 1)) for _ in seg_lens]
    rank = draw(st.sampled_from([1, 4, 8]))
    in_features = draw(st.sampled_from([3, 16, 33]))
    size = draw(st.integers(1, 20))
    offset = draw(st.integers(0, 5))
    seed = draw(st.integers(0, 2**16))
    return num_slots, seg_lens, seg_slots, rank, in_features, size, offset, seed


def _tensors(problem, dtype):
    num_slots, seg_lens, seg_slots, rank, in_features, size, offset, seed = problem
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(seg_lens)
    x = torch.randn(num_tokens, in_features, generator=gen, dtype=dtype)
    lora_a = torch.randn(num_slots, rank, in_features, generator=gen, dtype=dtype)
    lora_b = torch.randn(num_slots, size, rank, generator=gen, dtype=dtype)
    output = torch.randn(num_tokens, offset + size + 2, generator=gen, dtype=dtype)
    starts = torch.tensor([sum(seg_lens[:i]) for i in range(len(seg_lens))], dtype=torch.int64)
    return x, lora_a, lora_b, output, starts, torch.tensor(seg_lens), torch.tensor(seg_slots)


@pytest.mark.parametrize("name", KERNELS)
@settings(max_examples=25)
@given(problem=problems(), add=st.booleans(), scale=st.sampled_from([1.0, 0.5]))
def test_kernels_match_reference(name, problem, add, scale):
    with kernel_named(name) as kernel:
        check_against_reference(name, kernel, problem, add, scale)


def check_against_reference(name, kernel, problem, add, scale):
    dtype = torch.float32 if name == "triton" else torch.float64
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-9, rtol=1e-9)
    x, lora_a, lora_b, output, starts, lens, slots = _tensors(problem, dtype)
    offset = problem[6]
    indices = ref.segments_to_indices(x.shape[0], starts, lens, slots)
    # BGMV: one slot per row
    want_h = ref.bgmv_shrink(x, lora_a, indices, scale)
    got_h = kernel.bgmv_shrink(x, lora_a, indices, scale)
    assert got_h.dtype == torch.promote_types(dtype, torch.float32) and got_h.shape == want_h.shape
    torch.testing.assert_close(got_h, want_h, **tol)
    assert not got_h[indices < 0].any()  # rows without an adapter: zeros
    want = ref.bgmv_expand(want_h, lora_b, indices, output.clone(), offset, add)
    got = kernel.bgmv_expand(want_h, lora_b, indices, output.clone(), offset, add)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got[indices < 0], output[indices < 0], atol=0, rtol=0)  # untouched
    # SGMV: the same rows as segments
    torch.testing.assert_close(kernel.sgmv_shrink(x, lora_a, starts, lens, slots, scale), want_h, **tol)
    got_s = kernel.sgmv_expand(want_h, lora_b, starts, lens, slots, output.clone(), offset, add)
    torch.testing.assert_close(got_s, want, **tol)


@pytest.mark.parametrize("name", KERNELS)
def test_expand_into_fused_slices_of_a_strided_view(name):
    """A fused layer's expand: y is a column block of the shrink output and lora_b a row block
    of the stacked buffer (both non-contiguous views), written at the slice's offset."""
    with kernel_named(name) as kernel:
        check_fused_slices(kernel)


def check_fused_slices(kernel):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(6, 3 * 4, generator=gen)
    stacked_b = torch.randn(2, 10, 4, generator=gen)
    indices = torch.tensor([0, 1, -1, 1, 0, 0])
    out = torch.zeros(6, 10)
    want = out.clone()
    for j, (start, size) in enumerate([(0, 4), (4, 3), (7, 3)]):
        y, b = h[:, j * 4:(j + 1) * 4], stacked_b[:, start:start + size]
        kernel.bgmv_expand(y, b, indices, out, start, True)
        ref.bgmv_expand(y, b, indices, want, start, True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert not out[2].any()


def test_registry_names_and_swapping():
    assert {"cpu", "torch", "triton", "reference"} <= set(available_lora_kernels())
    assert get_lora_kernel("auto").name == "cpu"  # a CPU: the C kernel (the torch path where it does not apply)
    with pytest.raises(ValueError, match="unknown LoRA kernel 'nope'"):
        get_lora_kernel("nope")
    with pytest.raises(TypeError, match="lacks sgmv_shrink"):
        register_lora_kernel("broken", type("K", (), {"bgmv_shrink": lambda *a: None,
                                                      "bgmv_expand": lambda *a: None})())
    register_lora_kernel("reference-copy", "servelab.reference.lora:REFERENCE_KERNEL", override=True)
    assert get_lora_kernel("reference-copy").bgmv_shrink is ref.bgmv_shrink


def test_mapping_merges_adjacent_requests_of_one_slot():
    m = LoRAMapping.from_requests([0, 0, -1, 1, 1], [3, 1, 2, 1, 1])
    assert m.seg_starts.tolist() == [0, 4, 6] and m.seg_lens.tolist() == [4, 2, 2]
    assert m.seg_slots.tolist() == [0, -1, 1]
    assert m.indices.tolist() == [0, 0, 0, 0, -1, -1, 1, 1] and not m.decode and m.any_adapter
    d = LoRAMapping.from_requests([-1, -1], [1, 1])
    assert d.decode and not d.any_adapter
