"""The KV block layer: what a KV cache is made of and who owns which block.

- :mod:`~servelab.blocks.specs`: ``KVCacheSpec`` frozen dataclasses (full
  attention, sliding window, MLA, Mamba) with page sizes and memory bounds.
- :mod:`~servelab.blocks.layout`: one flat int8 buffer, per-layer views.
- :mod:`~servelab.blocks.hashing`: chained block hashes for prefix caching.
- :mod:`~servelab.blocks.interfaces`: the seams as runtime-checkable
  protocols — ``KVCacheManagerProtocol``, ``BlockPoolProtocol``,
  ``EvictionPolicy`` — whose docstrings are the contract.
- :mod:`~servelab.blocks.block_pool`: ``BlockPool`` — ref counts, the O(1)
  free queue of empty blocks, the prefix-cache index.
- :mod:`~servelab.blocks.eviction`: eviction policies (``"lru"`` default,
  ``"lfu"``, ``"fewest_descendants"``) and their registry
  (``register_eviction_policy`` / ``get_eviction_policy`` /
  ``available_eviction_policies``).
- :mod:`~servelab.blocks.kv_cache_manager`: ``KVCacheManager`` — prefix hits,
  all-or-nothing slot allocation, and ``cache_blocks`` after compute.
- :mod:`~servelab.blocks.hybrid`: ``HybridKVCacheManager`` — several KV-cache
  groups (full attention, sliding window, Mamba) in one pool, one block table
  per group, prefix hits every group can serve.
- :mod:`~servelab.blocks.events`: KV-cache events (``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``, batched per step in a
  ``KVEventBatch``: vLLM's vocabulary), off by default, and ``KVEventIndex``
  (the cached set rebuilt from events alone).
- :mod:`~servelab.blocks.single_type`: per-spec accounting and the spec ->
  manager registry (resolved along the MRO).

The rule the layer keeps (**commit after compute**): a block becomes findable
by prefix lookup only after the step that writes its KV succeeded —
``allocate_slots`` never indexes, ``cache_blocks`` (called by the scheduler
after the step) does. Every public method of the pool and the manager either
fully applies or leaves no trace.

Swapping the eviction policy::

    from servelab.blocks import BlockPool, KVCacheManager
    manager = KVCacheManager(spec, 4096, eviction_policy="lfu")
    # or: KVCacheManager(spec, 4096, block_pool=BlockPool(4096, eviction_policy=MyPolicy()))

Plain-Python references of the pool and manager live in
:mod:`servelab.reference.block_pool` and
:mod:`servelab.reference.kv_cache_manager`.
"""

from servelab.blocks.block_pool import NULL_BLOCK_ID, BlockPool
from servelab.blocks.eviction import (
    FewestDescendantsEvictionPolicy,
    LFUEvictionPolicy,
    LRUEvictionPolicy,
    available_eviction_policies,
    get_eviction_policy,
    register_eviction_policy,
)
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
from servelab.blocks.interfaces import BlockPoolProtocol, EvictionPolicy, KVCacheManagerProtocol
from servelab.blocks.kv_cache_manager import KVCacheManager, PrefixCacheStats
from servelab.blocks.hybrid import HybridKVCacheManager, KVCacheGroup, make_kv_cache_groups, unify_page_sizes
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
    "NULL_BLOCK_ID", "NONE_HASH", "AttentionSpec", "BlockHash", "BlockPool", "BlockPoolProtocol", "EvictionPolicy",
    "FewestDescendantsEvictionPolicy", "FreeBlockQueue", "KVCacheManagerProtocol", "LFUEvictionPolicy",
    "LRUEvictionPolicy", "available_eviction_policies", "get_eviction_policy", "register_eviction_policy",
    "FullAttentionManager", "FullAttentionSpec", "KVCacheBlock", "KVCacheBuffers", "KVCacheManager",
    "KVCacheRequest", "KVCacheSpec", "MLAAttentionSpec", "MambaManager", "MambaSpec", "MultiModalSpan",
    "PrefixCacheStats", "RequestBlockHasher", "SingleTypeManager", "SlidingWindowManager",
    "SlidingWindowSpec", "TokenSequence", "allocate_kv_cache", "block_extra_keys", "expand_block_table",
    "hash_block_tokens", "layer_views", "manager_class_for", "none_hash", "register_spec_manager",
    "HybridKVCacheManager", "KVCacheGroup", "make_kv_cache_groups", "unify_page_sizes",
]
