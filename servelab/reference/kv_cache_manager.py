"""Reference ``KVCacheManager``: the contract of
:class:`servelab.blocks.KVCacheManager` written as definitions rather than
algorithms, over the reference pool (blocks are ints).

- A prefix hit of ``L`` blocks is valid when every block the next token can
  see is cached: all of ``[0, L)`` for full attention, the last
  ``ceil((window - 1) / block_size)`` of them for a sliding window. The hit is
  the largest valid ``L`` within ``num_tokens - 1`` tokens, found by trying
  every ``L`` from the largest down.
- A sliding-window block is dead when every token in it is older than the
  window of the next token to compute.
- Mamba: one block per request, no prefix caching.
- Commit after compute: ``allocate_slots`` never indexes; ``cache_blocks``
  indexes the full blocks of the first ``num_computed_tokens`` tokens.
- Atomic: everything is checked (fit included) before anything changes.
- Stats: counted once per admission, when ``allocate_slots`` admits.

Shapes are the Protocol's: ``get_block_ids`` and ``allocate_slots`` answer
1-tuples (one KV-cache group). Constructor arguments are the fast manager's; ``eviction_policy`` must be a
name the reference pool models (``"lru"``, ``"lfu"``,
``"fewest_descendants"``) and ``block_pool`` a reference ``BlockPool``.
"""

from __future__ import annotations

from collections.abc import Sequence

from servelab.blocks.kv_cache_manager import PrefixCacheStats
from servelab.blocks.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from servelab.reference.block_pool import NULL_BLOCK_ID, BlockPool


class KVCacheManager:
    """Reference manager for the built-in specs (full, MLA, sliding window, Mamba)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, enable_caching: bool = True, *,
                 max_model_len: int | None = None, watermark: float = 0.0,
                 eviction_policy: str | None = None, block_pool: BlockPool | None = None) -> None:
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, MambaSpec)):
            raise ValueError(f"the reference manager does not model {type(spec).__name__}")
        if enable_caching and isinstance(spec, MambaSpec):
            raise ValueError("enable_caching=True is not supported for MambaSpec")
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or max_model_len < 1):
            raise ValueError(f"max_model_len={max_model_len!r} must be a positive int or None")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark={watermark!r} must be in [0, 1)")
        if block_pool is None:
            block_pool = BlockPool(num_blocks, enable_caching, eviction_policy=eviction_policy or "lru")
        elif eviction_policy is not None:
            raise ValueError("with block_pool= give the eviction policy to that BlockPool")
        self.spec = spec
        self.block_size = spec.block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self._pool = None
        self._num_blocks = num_blocks
        self.block_pool = block_pool

    @property
    def block_pool(self) -> BlockPool:
        return self._pool

    @block_pool.setter
    def block_pool(self, pool: BlockPool) -> None:
        if self.req_to_blocks:
            raise ValueError("cannot replace block_pool while requests hold blocks; free them first")
        if not isinstance(pool, BlockPool):
            raise TypeError(f"block_pool must be a servelab.reference.BlockPool, got {type(pool).__name__}")
        if pool.num_blocks != self._num_blocks or pool.enable_caching != self.enable_caching:
            raise ValueError("block_pool must have the manager's num_blocks and enable_caching")
        if pool.num_free_blocks != pool.num_blocks - 1:
            raise ValueError("a pool is handed over with every block free")
        self._pool = pool
        self.num_cached.clear()

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self._pool.usage

    def get_block_ids(self, request) -> tuple[list[int]]:
        """One KV-cache group: the row as a 1-tuple."""
        request_id = request if isinstance(request, str) else request.request_id
        return (list(self.req_to_blocks.get(request_id, [])),)

    def _blocks_for(self, num_tokens: int) -> int:
        if isinstance(self.spec, MambaSpec):
            return 1 if num_tokens > 0 else 0
        return (num_tokens + self.block_size - 1) // self.block_size

    def _visible_blocks(self, num_blocks: int) -> range:
        """Blocks the token right after a prefix of ``num_blocks`` blocks can see."""
        if isinstance(self.spec, SlidingWindowSpec):
            needed = (self.spec.sliding_window - 1 + self.block_size - 1) // self.block_size
            return range(max(0, num_blocks - needed), num_blocks)
        return range(num_blocks)

    def get_computed_blocks(self, request) -> tuple[tuple[list[int]], int]:
        """The longest hit, per group (one group: ``([id, ...],)``), and its tokens."""
        if not self.enable_caching:
            return ([],), 0
        hashes = request.block_hashes
        longest = min(max(request.num_tokens - 1, 0) // self.block_size, len(hashes))
        for num_blocks in range(longest, -1, -1):
            visible = self._visible_blocks(num_blocks)
            if all(self._pool.get_cached_block(hashes[i]) is not None for i in visible):
                blocks = [self._pool.get_cached_block(hashes[i]) if i in visible else NULL_BLOCK_ID
                          for i in range(num_blocks)]
                return (blocks,), num_blocks * self.block_size
        return ([],), 0  # unreachable: zero blocks are always a valid hit

    def _dead(self, block_index: int, num_computed_tokens: int) -> bool:
        if not isinstance(self.spec, SlidingWindowSpec):
            return False
        last_token_in_block = (block_index + 1) * self.block_size - 1
        oldest_visible = num_computed_tokens - self.spec.sliding_window + 1
        return last_token_in_block < oldest_visible

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: tuple[Sequence[int]] | None = None,
                       num_lookahead_tokens: int = 0) -> tuple[list[int]] | None:
        for name, value in (("num_new_tokens", num_new_tokens), ("num_new_computed_tokens", num_new_computed_tokens),
                            ("num_lookahead_tokens", num_lookahead_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        rid = request.request_id
        if new_computed_blocks is not None and (type(new_computed_blocks) is not tuple
                                                or len(new_computed_blocks) != 1):
            raise TypeError("new_computed_blocks must be None or ([id, ...],), as get_computed_blocks returns")
        hit = list(new_computed_blocks[0]) if new_computed_blocks else []
        if len(hit) * self.block_size != num_new_computed_tokens:
            raise ValueError("num_new_computed_tokens must equal len(new_computed_blocks) * block_size")
        held = self.req_to_blocks.get(rid)
        if hit and held:
            raise ValueError("prefix hits apply on admission only")
        real_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if self.max_model_len is not None and real_tokens > self.max_model_len:
            raise ValueError("over max_model_len")
        slots = real_tokens + num_lookahead_tokens
        if self.max_model_len is not None:
            slots = min(slots, self.max_model_len)

        # Plan: dead blocks (last first), the blocks to add, whether it all fits.
        current = list(held or [])
        dead = [] if hit else [i for i in reversed(range(len(current)))
                               if current[i] != NULL_BLOCK_ID and self._dead(i, request.num_computed_tokens)]
        num_new_blocks = max(0, self._blocks_for(slots) - len(current) - len(hit))
        revived = [b for b in hit if b != NULL_BLOCK_ID and self._pool.ref_cnt[b] == 0]
        freed_by_release = [current[i] for i in dead if self._pool.ref_cnt[current[i]] == 1]
        available = self._pool.num_free_blocks + len(freed_by_release)
        if not held and any(r != rid for r in self.req_to_blocks):
            available -= self.watermark_blocks
        if num_new_blocks + len(revived) > available:
            return None

        # Commit: take the hit, release dead blocks, then allocate.
        self._pool.touch(hit)
        self._pool.free_blocks([current[i] for i in dead])
        for i in dead:
            current[i] = NULL_BLOCK_ID
        new_blocks = self._pool.get_new_blocks(num_new_blocks)
        self.req_to_blocks[rid] = current + hit + new_blocks
        if hit:
            self.num_cached[rid] = len(hit)
        if held is None and self.enable_caching:
            self.prefix_cache_stats.requests += 1
            self.prefix_cache_stats.queried_tokens += request.num_tokens
            self.prefix_cache_stats.hit_tokens += num_new_computed_tokens
        return (new_blocks,)

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        if isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, int) \
                or num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens={num_computed_tokens!r} must be an int >= 0")
        rid = request.request_id
        held = self.req_to_blocks.get(rid)
        if not self.enable_caching or not held:
            return
        if num_computed_tokens > min(request.num_tokens, len(held) * self.block_size):
            raise ValueError("num_computed_tokens exceeds the request's tokens or slots")
        full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        done = self.num_cached.get(rid, 0)
        if full > done:
            self._pool.cache_full_blocks(held, request.block_hashes, done, full)
            self.num_cached[rid] = full

    def free(self, request) -> None:
        rid = request if isinstance(request, str) else request.request_id
        self._pool.free_blocks(list(reversed(self.req_to_blocks.get(rid, []))))
        self.req_to_blocks.pop(rid, None)
        self.num_cached.pop(rid, None)

    def reset_prefix_cache(self) -> bool:
        return self._pool.reset_prefix_cache()
