"""The "cpu" LoRA kernel (C, float32: servelab/lora/cpu_kernels.py) against the per-row float64
reference (servelab.reference.lora) on random shapes: rows 1..40, slots 1..8, ranks 1..64, odd
widths, rows without an adapter (-1), slice offsets into a wider (row-strided) output, strided
y / B views, segments (gaps, overlaps), add or overwrite; the fused one-call-per-layer form
against the reference slice by slice and inside a LoRALinear; the fallbacks; bad input."""

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from servelab.lora import cpu_kernels, ops
from servelab.lora.kernels import LoRAMapping, get_lora_kernel
from servelab.lora.layers import LoRALinear, LoRAStepState
from servelab.models.layer_api import OutputSlice, set_output_slices
from servelab.reference import lora as ref

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: the C LoRA kernel is not built")

TOL = dict(atol=2e-4, rtol=2e-4)


@contextlib.contextmanager
def c_only():
    """The torch fallback raises: code under it runs the C path or fails."""
    def refuse(*args, **kwargs):
        raise AssertionError("the torch fallback ran")
    names = ("bgmv_shrink", "bgmv_expand", "sgmv_shrink", "sgmv_expand")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(ops, name, refuse))
        yield


@st.composite
def problems(draw):
    num_slots = draw(st.integers(1, 8))
    seg_lens = draw(st.lists(st.integers(0, 12), min_size=1, max_size=6).filter(lambda v: 1 <= sum(v) <= 40))
    seg_slots = [draw(st.integers(-1, num_slots - 1)) for _ in seg_lens]
    return dict(num_slots=num_slots, seg_lens=seg_lens, seg_slots=seg_slots, rank=draw(st.integers(1, 64)),
                fan_in=draw(st.integers(1, 100)), size=draw(st.integers(1, 70)), offset=draw(st.integers(0, 9)),
                strided=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def _tensors(p):
    gen = torch.Generator().manual_seed(p["seed"])
    rows, rank, size = sum(p["seg_lens"]), p["rank"], p["size"]
    x = torch.randn(rows, p["fan_in"], generator=gen)
    lora_a = torch.randn(p["num_slots"], rank, p["fan_in"], generator=gen)
    if p["strided"]:  # y a column block of a wider h, B a row block of a taller (or transposed) buffer
        y = torch.randn(rows, rank + 5, generator=gen)[:, 2:2 + rank]
        lora_b = torch.randn(p["num_slots"], rank, size + 3, generator=gen).transpose(1, 2)[:, 1:1 + size]
        output = torch.randn(rows, p["offset"] + size + 11, generator=gen)[:, 3:]  # rows strided
    else:
        y = torch.randn(rows, rank, generator=gen)
        lora_b = torch.randn(p["num_slots"], size, rank, generator=gen)
        output = torch.randn(rows, p["offset"] + size + 2, generator=gen)
    starts = torch.tensor([sum(p["seg_lens"][:i]) for i in range(len(p["seg_lens"]))])
    return x, lora_a, y, lora_b, output, starts, torch.tensor(p["seg_lens"]), torch.tensor(p["seg_slots"])


def _f64(*tensors):
    return [t.double() for t in tensors]


@settings(max_examples=60, deadline=None)
@given(p=problems(), add=st.booleans(), scale=st.sampled_from([1.0, 0.5, 2.0]))
def test_c_kernels_match_the_reference(p, add, scale):
    with c_only():
        check_against_reference(p, add, scale)


def check_against_reference(p, add, scale):
    x, lora_a, y, lora_b, output, starts, lens, slots = _tensors(p)
    offset = p["offset"]
    indices = ref.segments_to_indices(x.shape[0], starts, lens, slots)
    x64, a64, y64, b64, out64 = _f64(x, lora_a, y, lora_b, output)
    want_h = ref.bgmv_shrink(x64, a64, indices, scale)
    got_h = cpu_kernels.bgmv_shrink(x, lora_a, indices, scale)
    assert got_h.dtype == torch.float32 and got_h.shape == want_h.shape
    torch.testing.assert_close(got_h.double(), want_h, **TOL)
    assert not got_h[indices < 0].any()  # rows without an adapter: zeros
    torch.testing.assert_close(cpu_kernels.sgmv_shrink(x, lora_a, starts, lens, slots, scale).double(), want_h, **TOL)
    want = ref.bgmv_expand(y64, b64, indices, out64.clone(), offset, add)
    for got in (cpu_kernels.bgmv_expand(y, lora_b, indices, output.clone(), offset, add),
                cpu_kernels.sgmv_expand(y, lora_b, starts, lens, slots, output.clone(), offset, add)):
        torch.testing.assert_close(got.double(), want, **TOL)
        assert torch.equal(got[indices < 0], output[indices < 0])  # untouched
        assert torch.equal(got[:, :offset], output[:, :offset])  # outside the slice: untouched


def test_overlapping_segments_and_rows_outside_them():
    """Later segments win where they overlap; rows in no segment get zeros / are untouched."""
    gen = torch.Generator().manual_seed(1)
    x, lora_a = torch.randn(9, 20, generator=gen), torch.randn(3, 5, 20, generator=gen)
    lora_b, output = torch.randn(3, 7, 5, generator=gen), torch.randn(9, 7, generator=gen)
    segs = torch.tensor([0, 2, 7]), torch.tensor([4, 3, 9]), torch.tensor([1, 2, 0])  # rows 5-6 none, 7.. clipped
    indices = ref.segments_to_indices(9, *segs)
    want_h = ref.bgmv_shrink(x.double(), lora_a.double(), indices)
    want = ref.bgmv_expand(want_h, lora_b.double(), indices, output.double().clone())
    with c_only():
        torch.testing.assert_close(cpu_kernels.sgmv_shrink(x, lora_a, *segs).double(), want_h, **TOL)
        got = cpu_kernels.sgmv_expand(want_h.float(), lora_b, *segs, output.clone())
    torch.testing.assert_close(got.double(), want, **TOL)


@st.composite
def layers(draw):
    num_slots, max_rank = draw(st.integers(1, 8)), draw(st.integers(1, 64))
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    # each slot's rank per slice, 0: its adapter leaves the slice alone
    ranks = [[draw(st.sampled_from([0, 1, max_rank, draw(st.integers(1, max_rank))])) for _ in sizes]
             for _ in range(num_slots)]
    rows = draw(st.integers(1, 40))
    indices = [draw(st.integers(-1, num_slots - 1)) for _ in range(rows)]
    return dict(max_rank=max_rank, sizes=sizes, ranks=ranks, indices=indices, fan_in=draw(st.integers(1, 100)),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=50, deadline=None)
@given(p=layers())
def test_fused_layer_matches_the_reference_slice_by_slice(p):
    check_fused(p)


def check_fused(p):
    gen = torch.Generator().manual_seed(p["seed"])
    r_max, sizes, ranks = p["max_rank"], p["sizes"], p["ranks"]
    num_slots, rows, out_features = len(ranks), len(p["indices"]), sum(sizes)
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    lora_a = torch.zeros(num_slots, len(sizes) * r_max, p["fan_in"])
    lora_b = torch.zeros(num_slots, out_features, r_max)
    for s in range(num_slots):  # the LoRALinear layout: zero past each rank, zero where left alone
        for j, (start, size) in enumerate(zip(starts, sizes)):
            lora_a[s, j * r_max:j * r_max + ranks[s][j]] = torch.randn(ranks[s][j], p["fan_in"], generator=gen)
            lora_b[s, start:start + size, :ranks[s][j]] = torch.randn(size, ranks[s][j], generator=gen)
    x = torch.randn(rows, p["fan_in"], generator=gen)
    out = torch.randn(rows, out_features + 4, generator=gen)[:, 2:2 + out_features]  # a row-strided view
    indices = torch.tensor(p["indices"])
    want = out.double().clone()
    h = ref.bgmv_shrink(x.double(), lora_a.double(), indices)
    for j, (start, size) in enumerate(zip(starts, sizes)):
        ref.bgmv_expand(h[:, j * r_max:(j + 1) * r_max], lora_b[:, start:start + size].double(), indices, want, start)
    before = out.clone()
    assert cpu_kernels.add_layer_deltas(x, out, lora_a, lora_b, torch.tensor([starts, sizes]), torch.tensor(ranks),
                                        r_max, indices)
    torch.testing.assert_close(out.double(), want, **TOL)
    assert torch.equal(out[indices < 0], before[indices < 0])


def _wrapped(kernel, max_loras=4, max_rank=8):
    base = nn.Linear(24, 30, bias=True)
    set_output_slices(base, (OutputSlice("q_proj", 0, 16), OutputSlice("k_proj", 16, 8),
                             OutputSlice("v_proj", 24, 6)))
    state = LoRAStepState(get_lora_kernel(kernel))
    layer = LoRALinear(base, "model.layers.0.self_attn.qkv_proj", max_loras=max_loras, max_rank=max_rank, state=state,
                       dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    for slot, (rank, parts) in enumerate([(8, [0, 1, 2]), (3, [0, 2]), (5, [1])]):
        layer.set_slot(slot, {names[j]: (torch.randn(rank, 24, generator=gen),
                                         torch.randn(size, rank, generator=gen))
                              for j, size in ((j, (16, 8, 6)[j]) for j in parts)})
    assert layer.slot_ranks.tolist() == [[8, 8, 8], [3, 0, 3], [0, 5, 0], [0, 0, 0]]
    assert layer.lora_b.shape == (max_loras, 30, max_rank) and layer.lora_b.stride(1) == 1  # stored [slot, r, n]
    return layer, state


@pytest.mark.parametrize("kernel", ["cpu", "torch"])
@pytest.mark.parametrize("decode", [True, False])
def test_lora_linear_fused_call_matches_the_reference_kernel(decode, kernel):
    """LoRALinear with the "cpu" kernel (one C call; and "torch", over the same [slot, r, n] storage
    of B) against the same layer with the reference."""
    fused, state = _wrapped(kernel)
    plain, plain_state = _wrapped("reference")
    plain.load_state_dict(fused.state_dict())
    slots = [0, 1, -1, 2, 1, 0, 3]
    mapping = LoRAMapping.from_requests(slots, [1 if decode else 3] * len(slots))
    state.mapping = plain_state.mapping = mapping
    x = torch.randn(mapping.num_tokens, 24)
    with torch.no_grad():
        got, want = fused(x), plain(x)
        base = fused.base(x)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(got[mapping.indices < 0], base[mapping.indices < 0])
    assert torch.equal(got[mapping.indices == 3], base[mapping.indices == 3])  # an empty slot adds nothing
    fused.clear_slot(0)
    assert not fused.slot_ranks[0].any()


def test_threads_give_the_same_bits():
    """Columns are split between threads; every value is the same arithmetic whatever the team."""
    gen = torch.Generator().manual_seed(2)
    x, lora_a = torch.randn(33, 300, generator=gen), torch.randn(6, 48, 300, generator=gen)
    lora_b, indices = torch.randn(6, 200, 48, generator=gen), torch.randint(-1, 6, (33,), generator=gen)
    results = []
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            h = cpu_kernels.bgmv_shrink(x, lora_a, indices)
            results.append((h, cpu_kernels.bgmv_expand(h, lora_b, indices, torch.zeros(33, 200))))
    finally:
        torch.set_num_threads(saved)
    for h, out in results[1:]:
        assert torch.equal(h, results[0][0]) and torch.equal(out, results[0][1])


def test_other_dtypes_run_the_torch_path():
    """float64 (and bf16) inputs are not the C kernel's: the torch path, same contract."""
    gen = torch.Generator().manual_seed(4)
    x, lora_a = torch.randn(5, 9, generator=gen, dtype=torch.float64), torch.randn(2, 3, 9, generator=gen,
                                                                                   dtype=torch.float64)
    indices = torch.tensor([0, -1, 1, 1, 0])
    h = cpu_kernels.bgmv_shrink(x, lora_a, indices)
    assert h.dtype == torch.float64
    torch.testing.assert_close(h, ref.bgmv_shrink(x, lora_a, indices), atol=1e-12, rtol=1e-12)
    out = torch.zeros(5, 4, dtype=torch.bfloat16)
    assert not cpu_kernels.add_layer_deltas(x.bfloat16(), out, lora_a.bfloat16(), torch.zeros(2, 4, 3),
                                            torch.tensor([[0], [4]]), torch.tensor([[3], [3]]), 3, indices)


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv("SERVELAB_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    assert cpu_kernels.library() is None and cpu_kernels.unavailable_reason() == "SERVELAB_CPU_KERNELS=0"
    x, lora_a = torch.randn(3, 8), torch.randn(2, 4, 8)
    indices = torch.tensor([1, 0, -1])
    torch.testing.assert_close(cpu_kernels.bgmv_shrink(x, lora_a, indices),
                               ref.bgmv_shrink(x, lora_a, indices), **TOL)  # the torch path


def test_bad_input_is_refused_naming_it():
    x, lora_a = torch.randn(3, 8), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="indices holds slot 2; valid: -1 .* to 1"):
        cpu_kernels.bgmv_shrink(x, lora_a, torch.tensor([0, 2, -1]))
    with pytest.raises(ValueError, match=r"indices has shape \(2,\); valid: \[3\]"):
        cpu_kernels.bgmv_shrink(x, lora_a, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="seg_slots holds slot 5"):
        cpu_kernels.sgmv_shrink(x, lora_a, torch.tensor([0]), torch.tensor([3]), torch.tensor([5]))
    with pytest.raises(ValueError, match="slice_offset=3 with 6 columns does not fit output's 8"):
        cpu_kernels.bgmv_expand(torch.randn(3, 4), torch.randn(2, 6, 4), torch.tensor([0, 1, 0]),
                                torch.zeros(3, 8), slice_offset=3)
    with pytest.raises(ValueError, match="indices holds slot 7"):
        cpu_kernels.add_layer_deltas(x, torch.zeros(3, 6), lora_a, torch.zeros(2, 6, 4), torch.tensor([[0], [6]]),
                                     torch.tensor([[4], [4]]), 4, torch.tensor([7, 0, 0]))


def test_rank_zero_and_empty_shapes():
    """Rank 0 (overwrite writes zero deltas), no rows, no output columns, in_features 0."""
    indices = torch.tensor([1, -1, 0])
    out = torch.ones(3, 5)
    got = cpu_kernels.bgmv_expand(torch.zeros(3, 0), torch.zeros(2, 5, 0), indices, out.clone(), 0, False)
    torch.testing.assert_close(got, ref.bgmv_expand(torch.zeros(3, 0), torch.zeros(2, 5, 0), indices, out.clone(), 0,
                                                    False))
    assert cpu_kernels.bgmv_shrink(torch.zeros(0, 8), torch.zeros(2, 4, 8), torch.zeros(0, dtype=torch.int64)
                                   ).shape == (0, 4)
    assert torch.equal(cpu_kernels.bgmv_expand(torch.ones(3, 4), torch.ones(2, 0, 4), indices, out.clone(), 5), out)
    assert not cpu_kernels.bgmv_shrink(torch.zeros(3, 0), torch.zeros(2, 4, 0), indices).any()


def test_the_portable_build_matches_the_reference(monkeypatch):
    """The library built without -march=native (no AVX-512: the plain C loops), OpenMP kept."""
    import shutil

    from servelab.attention import cpu_kernel_build as build
    if shutil.which(build.compiler()) is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(build, "FLAG_SETS", (("-O3", "-fopenmp"), ("-O3",)))
    lib, why = cpu_kernels._build()
    assert lib is not None, why
    monkeypatch.setattr(cpu_kernels, "_state", {"lib": lib, "why": ""})
    check_portable()


@settings(max_examples=15, deadline=None)
@given(p=problems(), add=st.booleans(), layer=layers())
def check_portable(p, add, layer):  # run by the test above (hypothesis inside a monkeypatch)
    with c_only():
        check_against_reference(p, add, 0.5)
    check_fused(layer)
