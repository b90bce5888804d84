"""The KV block layer: what a KV cache is made of and who owns which block.

- :mod:`~servelab.blocks.specs`: ``KVCacheSpec`` frozen dataclasses (full
  attention, sliding window, MLA, Mamba) with page sizes and memory bounds.
- :mod:`~servelab.blocks.layout`: one flat int8 buffer, per-layer views.
- :mod:`~servelab.blocks.hashing`: chained block hashes for prefix caching.
- :mod:`~servelab.blocks.block_pool`: ``BlockPool`` — ref counts, the O(1)
  free queue, the prefix-cache index, LRU eviction.
- :mod:`~servelab.blocks.kv_cache_manager`: ``KVCacheManager`` — prefix hits
  and all-or-nothing slot allocation per request.
- :mod:`~servelab.blocks.single_type`: per-spec accounting and the spec ->
  manager registry (resolved along the MRO).

Plain-Python references of the pool and manager live in
:mod:`servelab.reference.block_pool` and
:mod:`servelab.reference.kv_cache_manager`.
"""

from servelab.blocks.block_pool import NULL_BLOCK_ID, BlockPool
from servelab.blocks.free_queue import FreeBlockQueue, KVCacheBlock
from servelab.blocks.hashing import (
    NONE_HASH,
    BlockHash,
    MultiModalSpan,
    RequestBlockHasher,
    block_extra_keys,
    hash_block_tokens,
    none_hash,
)
from servelab.blocks.kv_cache_manager import KVCacheManager, PrefixCacheStats
from servelab.blocks.layout import KVCacheBuffers, allocate_kv_cache, expand_block_table, layer_views
from servelab.blocks.request import KVCacheRequest, TokenSequence
from servelab.blocks.single_type import (
    FullAttentionManager,
    MambaManager,
    SingleTypeManager,
    SlidingWindowManager,
    manager_class_for,
    register_spec_manager,
)
from servelab.blocks.specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "NULL_BLOCK_ID", "NONE_HASH", "AttentionSpec", "BlockHash", "BlockPool", "FreeBlockQueue",
    "FullAttentionManager", "FullAttentionSpec", "KVCacheBlock", "KVCacheBuffers", "KVCacheManager",
    "KVCacheRequest", "KVCacheSpec", "MLAAttentionSpec", "MambaManager", "MambaSpec", "MultiModalSpan",
    "PrefixCacheStats", "RequestBlockHasher", "SingleTypeManager", "SlidingWindowManager",
    "SlidingWindowSpec", "TokenSequence", "allocate_kv_cache", "block_extra_keys", "expand_block_table",
    "hash_block_tokens", "layer_views", "manager_class_for", "none_hash", "register_spec_manager",
]
