import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from servelab.blocks import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    allocate_kv_cache,
    expand_block_table,
    layer_views,
)
from servelab.blocks.layout import LAYOUTS

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}  # to compare raw bits


def _fill_and_check_isolation(kv, layer, tensors):
    before = kv.buffer.clone()
    for t in tensors:
        t.copy_(torch.randn(t.shape).to(t.dtype) + 1)  # +1: never all zeros
    changed = (kv.buffer != before).nonzero().flatten()
    assert changed.numel() > 0, "writing through a view must change the buffer"
    # Every changed byte belongs to this layer's views and no other layer's.
    for other, views in enumerate(kv.views):
        if other == layer:
            continue
        for v in views:
            assert not v.view(INT_OF_SIZE[v.element_size()]).any(), \
                f"layer {other} moved when layer {layer} was written"
    return changed


@given(
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    num_layers=st.integers(1, 4),
    num_blocks=st.integers(1, 5),
    block_size=st.sampled_from([1, 2, 4, 16]),
    heads=st.integers(1, 3),
    head_size=st.sampled_from([1, 8, 80]),
    data=st.data(),
)
def test_attention_views_are_disjoint_and_cover_the_buffer(layout, dtype, num_layers, num_blocks, block_size,
                                                           heads, head_size, data):
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    kv = allocate_kv_cache(spec, num_layers, num_blocks, layout=layout)
    assert kv.buffer.numel() == num_layers * num_blocks * spec.page_size_bytes
    for k, v in kv.views:
        assert k.shape == v.shape == (num_blocks, block_size, heads, head_size)
        assert k.dtype == v.dtype == dtype
    layer = data.draw(st.integers(0, num_layers - 1))
    _fill_and_check_isolation(kv, layer, kv.views[layer])
    # All views together cover every byte of the buffer exactly once.
    counts = torch.zeros(kv.buffer.numel(), dtype=torch.int64)
    for views in kv.views:
        for t in views:
            addr = _byte_addresses(t)
            for b in range(t.element_size()):
                counts.index_add_(0, (addr + b).flatten(), torch.ones(t.numel(), dtype=torch.int64))
    assert torch.equal(counts, torch.ones_like(counts)), "views must tile the buffer exactly"


def _byte_addresses(t: torch.Tensor) -> torch.Tensor:
    """Byte offset into the storage of every element of a strided view."""
    size = t.element_size()
    addr = torch.full(t.shape, t.storage_offset() * size, dtype=torch.int64)
    for d in range(t.dim()):
        shape = [1] * t.dim()
        shape[d] = t.shape[d]
        addr = addr + torch.arange(t.shape[d]).reshape(shape) * t.stride(d) * size
    return addr


def test_block_outermost_keeps_one_blocks_layers_contiguous():
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)
    kv = allocate_kv_cache(spec, num_layers=3, num_blocks=5, layout="block_outermost")
    page = spec.page_size_bytes
    for k, v in kv.views:
        k[2].view(torch.int16).fill_(257)  # both bytes non-zero
        v[2].view(torch.int16).fill_(257)
    touched = kv.buffer.nonzero().flatten()
    assert touched.tolist() == list(range(2 * 3 * page, 3 * 3 * page))


def test_sliding_window_and_mla_views():
    sw = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float16", sliding_window=5)
    k, v = allocate_kv_cache(sw, 2, 3).views[0]
    assert k.shape == (3, 4, 2, 8)
    mla = MLAAttentionSpec(block_size=4, head_size=12, dtype=torch.bfloat16)
    kv = allocate_kv_cache(mla, 2, 3, layout="block_outermost")
    (latent,) = kv.views[1]
    assert latent.shape == (3, 4, 12)
    _fill_and_check_isolation(kv, 1, kv.views[1])


def test_mamba_views_have_their_own_dtypes_and_are_isolated():
    spec = MambaSpec(block_size=16, shapes=((3, 5), (7,)), dtypes=(torch.float16, torch.float32))
    for layout in LAYOUTS:
        kv = allocate_kv_cache(spec, 3, 4, layout=layout)
        conv, ssm = kv.views[1]
        assert conv.shape == (4, 3, 5) and conv.dtype == torch.float16
        assert ssm.shape == (4, 7) and ssm.dtype == torch.float32
        _fill_and_check_isolation(kv, 1, kv.views[1])


def test_kernel_blocks_split_manager_blocks():
    spec = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=4, dtype=torch.float32)
    kv = allocate_kv_cache(spec, 2, 3)
    fine = allocate_kv_cache(spec, 2, 3, kernel_block_size=2)
    assert fine.views[0][0].shape == (12, 2, 1, 4)
    fine.buffer.copy_(torch.randint(-100, 100, fine.buffer.shape, dtype=torch.int8))
    coarse = layer_views(fine.buffer, spec, 2, 3)
    table = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32)
    expanded = expand_block_table(table, 4)
    assert expanded.tolist() == [[8, 9, 10, 11, 0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]]
    for layer in range(2):
        for t in range(2):
            for row in range(2):
                a = coarse[layer][t][table[row].long()].reshape(-1, 1, 4)
                b = fine.views[layer][t][expanded[row].long()].reshape(-1, 1, 4)
                assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # raw bits: random bytes may be NaN
    assert kv.kernel_block_size == 8


def test_layout_errors_say_what_to_change():
    spec = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="use layout='layer_outermost'"):
        allocate_kv_cache(spec, 2, 3, layout="block_outermost", kernel_block_size=4)
    with pytest.raises(ValueError, match="positive divisor of block_size=8"):
        allocate_kv_cache(spec, 2, 3, kernel_block_size=3)
    with pytest.raises(ValueError, match="layout="):
        allocate_kv_cache(spec, 2, 3, layout="interleaved")
    with pytest.raises(ValueError, match="num_layers"):
        allocate_kv_cache(spec, 0, 3)
    with pytest.raises(ValueError, match="buffer has"):
        layer_views(torch.zeros(10, dtype=torch.int8), spec, 2, 3)
    with pytest.raises(ValueError, match="1-D torch.int8"):
        layer_views(torch.zeros(10), spec, 2, 3)
    with pytest.raises(ValueError, match="ratio"):
        expand_block_table(torch.zeros(2, 2, dtype=torch.int32), 0)
