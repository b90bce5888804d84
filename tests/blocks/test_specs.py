import pytest
import torch

from servelab.blocks import (
    FullAttentionManager,
    FullAttentionSpec,
    KVCacheManager,
    KVCacheSpec,
    MambaManager,
    MambaSpec,
    MLAAttentionSpec,
    SingleTypeManager,
    SlidingWindowManager,
    SlidingWindowSpec,
    manager_class_for,
    register_spec_manager,
)

ATTN = dict(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)


def test_full_attention_page_and_max_memory():
    spec = FullAttentionSpec(**ATTN)
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 * 2
    # 4097 tokens need 257 blocks of 16.
    assert spec.max_memory_usage_bytes(4097) == 257 * spec.page_size_bytes


def test_mla_has_one_latent_tensor_and_reuses_full_manager_via_mro():
    spec = MLAAttentionSpec(block_size=16, head_size=576, dtype="float16")
    assert spec.num_kv_heads == 1
    assert spec.page_size_bytes == 16 * 576 * 2
    assert manager_class_for(spec) is FullAttentionManager


def test_sliding_window_max_memory_is_bounded_by_window_and_batch():
    spec = SlidingWindowSpec(**ATTN, sliding_window=4096)
    page = spec.page_size_bytes
    # window - 1 + batched tokens = 4095 + 2048 = 6143 tokens -> 384 blocks, +1 for misalignment.
    assert spec.max_memory_usage_bytes(32768, max_num_batched_tokens=2048) == 385 * page
    # Never more than the full sequence (+1).
    assert spec.max_memory_usage_bytes(100) == (7 + 1) * page
    assert manager_class_for(spec) is SlidingWindowManager


def test_mamba_page_aligns_each_state_to_the_largest_itemsize():
    spec = MambaSpec(block_size=16, shapes=((3, 5), (7,)), dtypes=(torch.float16, torch.float32))
    assert spec.state_offsets_bytes == (0, 32)  # 30 bytes of fp16, padded to a multiple of 4
    assert spec.page_size_bytes == 60
    assert spec.max_memory_usage_bytes(1 << 20) == 60  # independent of length
    assert manager_class_for(spec) is MambaManager


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(ATTN, block_size=0), "block_size"),
        (dict(ATTN, block_size=-16), "block_size"),
        (dict(ATTN, num_kv_heads=0), "num_kv_heads"),
        (dict(ATTN, head_size=-1), "head_size"),
        (dict(ATTN, dtype="float64"), "dtype"),
        (dict(ATTN, dtype=torch.complex64), "dtype"),
    ],
)
def test_invalid_attention_fields_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FullAttentionSpec(**kwargs)


def test_invalid_fields_of_other_specs():
    with pytest.raises(TypeError, match="block_size"):
        FullAttentionSpec(**dict(ATTN, block_size=16.0))
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(**ATTN, sliding_window=0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        MLAAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    with pytest.raises(ValueError, match="shapes"):
        MambaSpec(block_size=16, shapes=(), dtypes=())
    with pytest.raises(ValueError, match=r"shapes\[0\]"):
        MambaSpec(block_size=16, shapes=((0, 4),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="dtypes"):
        MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float32, torch.float32))
    with pytest.raises(ValueError, match="max_model_len"):
        FullAttentionSpec(**ATTN).max_memory_usage_bytes(0)


def test_specs_are_frozen_and_hashable():
    spec = FullAttentionSpec(**ATTN)
    with pytest.raises(AttributeError):
        spec.block_size = 32
    assert spec == FullAttentionSpec(**dict(ATTN, dtype="bf16"))
    assert len({spec, FullAttentionSpec(**ATTN)}) == 1


def test_unregistered_spec_is_refused_with_a_reason():
    class ChunkedLocalSpec(KVCacheSpec):
        pass

    with pytest.raises(ValueError, match="no block manager is registered for ChunkedLocalSpec"):
        KVCacheManager(ChunkedLocalSpec(block_size=16), 8)


def test_registering_a_manager_for_a_new_spec_and_a_subclass_override():
    class StridedSpec(FullAttentionSpec):
        pass

    assert manager_class_for(StridedSpec(**ATTN)) is FullAttentionManager  # inherited along the MRO

    @register_spec_manager(StridedSpec)
    class StridedManager(FullAttentionManager):
        pass

    assert manager_class_for(StridedSpec(**ATTN)) is StridedManager
    assert manager_class_for(FullAttentionSpec(**ATTN)) is FullAttentionManager
    with pytest.raises(TypeError):
        register_spec_manager(int)
    with pytest.raises(TypeError):
        register_spec_manager(StridedSpec)(object)
    assert issubclass(StridedManager, SingleTypeManager)


def test_mamba_refuses_prefix_caching_with_its_reason():
    spec = MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="enable_caching=True is not supported for MambaSpec"):
        KVCacheManager(spec, 8, enable_caching=True)
    KVCacheManager(spec, 8, enable_caching=False)
