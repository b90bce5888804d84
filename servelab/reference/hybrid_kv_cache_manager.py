"""Reference ``HybridKVCacheManager``: the contract of
:class:`servelab.blocks.hybrid.HybridKVCacheManager` written as definitions,
over the reference pool (blocks are ints).

- Group ``g`` names its block ``i`` by the request's hash ``(i + 1) * k_g - 1``
  (``k_g`` = group block size / smallest block size) plus the group id.
- Group ``g`` can serve a prefix of ``n`` of its blocks when every block the
  next token needs is cached: all ``n`` (full attention), the last
  ``ceil((window - 1) / block_size)`` (sliding window), the last one (Mamba
  with caching: the state at the prefix's end).
- The hit is the largest multiple ``L`` of the lcm of the block sizes, at most
  ``num_tokens - 1``, that *every* group can serve — found by trying every
  ``L`` from the largest down (no fixed-point iteration).
- Dead blocks: sliding window as in the single-group reference; Mamba with
  caching keeps blocks from the previous block boundary on; without caching a
  Mamba group holds one block.
- Order of pool calls (observable through the pool's free order): touch the
  hit group by group, free dead blocks group by group (last first), allocate
  all new blocks in one call split in group order; ``free`` goes group by
  group, each tail first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from servelab.blocks.hybrid import KVCacheGroup
from servelab.blocks.kv_cache_manager import PrefixCacheStats
from servelab.blocks.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from servelab.reference.block_pool import NULL_BLOCK_ID, BlockPool


class HybridKVCacheManager:
    """Reference hybrid manager for full-attention, sliding-window and Mamba groups."""

    def __init__(self, groups: Sequence[KVCacheGroup | KVCacheSpec], num_blocks: int, enable_caching: bool = True,
                 *, max_model_len: int | None = None, watermark: float = 0.0,
                 eviction_policy: str | None = None) -> None:
        self.specs = [g.spec if isinstance(g, KVCacheGroup) else g for g in groups]
        for spec in self.specs:
            if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, MambaSpec)):
                raise ValueError(f"the reference does not model {type(spec).__name__}")
        self.block_size = min(s.block_size for s in self.specs)
        self.hit_alignment = math.lcm(*(s.block_size for s in self.specs))
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self.block_pool = BlockPool(num_blocks, enable_caching, eviction_policy=eviction_policy or "lru")
        self.req_to_blocks: dict[str, list[list[int]]] = {}
        self.num_cached: dict[str, list[int]] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_block_ids(self, request) -> tuple[list[int], ...]:
        rid = request if isinstance(request, str) else request.request_id
        return tuple(list(b) for b in self.req_to_blocks.get(rid, [[] for _ in self.specs]))

    def group_hashes(self, request, g: int) -> list[bytes]:
        k = self.specs[g].block_size // self.block_size
        base = request.block_hashes
        return [base[(i + 1) * k - 1] + g.to_bytes(2, "little") for i in range(len(base) // k)]

    def _needed(self, g: int, n: int) -> range:
        """Block positions group g needs cached to serve a prefix of n of its blocks."""
        spec = self.specs[g]
        if isinstance(spec, SlidingWindowSpec):
            need = -(-(spec.sliding_window - 1) // spec.block_size)
            return range(max(0, n - need), n)
        if isinstance(spec, MambaSpec):
            return range(max(0, n - 1), n)
        return range(n)

    def get_computed_blocks(self, request):
        empty = tuple([] for _ in self.specs)
        if not self.enable_caching:
            return empty, 0
        hashes = [self.group_hashes(request, g) for g in range(len(self.specs))]
        longest = min(max(request.num_tokens - 1, 0), len(request.block_hashes) * self.block_size)
        pool = self.block_pool
        for length in range(longest // self.hit_alignment * self.hit_alignment, -1, -self.hit_alignment):
            counts = [length // s.block_size for s in self.specs]
            if all(pool.get_cached_block(hashes[g][i]) is not None
                   for g, n in enumerate(counts) for i in self._needed(g, n)):
                if length == 0:
                    return empty, 0
                return tuple([pool.get_cached_block(hashes[g][i]) if i in self._needed(g, n) else NULL_BLOCK_ID
                              for i in range(n)] for g, n in enumerate(counts)), length
        return empty, 0  # unreachable: length 0 always qualifies

    def _blocks_for(self, g: int, num_tokens: int) -> int:
        if isinstance(self.specs[g], MambaSpec) and not self.enable_caching:
            return 1 if num_tokens > 0 else 0
        return -(-num_tokens // self.specs[g].block_size)

    def _dead(self, g: int, i: int, num_computed: int) -> bool:
        spec = self.specs[g]
        if isinstance(spec, SlidingWindowSpec):
            window = spec.sliding_window
        elif isinstance(spec, MambaSpec) and self.enable_caching:
            window = spec.block_size + 1
        else:
            return False
        return (i + 1) * spec.block_size - 1 < num_computed - window + 1

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks=None, num_lookahead_tokens: int = 0):
        for name, value in (("num_new_tokens", num_new_tokens), ("num_new_computed_tokens", num_new_computed_tokens),
                            ("num_lookahead_tokens", num_lookahead_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        rid = request.request_id
        hit = [list(b) for b in new_computed_blocks] if new_computed_blocks else [[] for _ in self.specs]
        if any(len(h) * s.block_size != num_new_computed_tokens for h, s in zip(hit, self.specs)):
            raise ValueError("num_new_computed_tokens must equal len(new_computed_blocks[g]) * block_size")
        held = self.req_to_blocks.get(rid)
        if num_new_computed_tokens and held:
            raise ValueError("prefix hits apply on admission only")
        real = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if self.max_model_len is not None and real > self.max_model_len:
            raise ValueError("over max_model_len")
        slots = real + num_lookahead_tokens
        if self.max_model_len is not None:
            slots = min(slots, self.max_model_len)
        pool = self.block_pool
        current = [list(b) for b in held] if held else [[] for _ in self.specs]
        dead = [[] if num_new_computed_tokens else
                [i for i in reversed(range(len(c))) if c[i] != NULL_BLOCK_ID
                 and self._dead(g, i, request.num_computed_tokens)] for g, c in enumerate(current)]
        counts = [max(0, self._blocks_for(g, slots) - len(current[g]) - len(hit[g])) for g in range(len(self.specs))]
        revived = [b for h in hit for b in h if b != NULL_BLOCK_ID and pool.ref_cnt[b] == 0]
        freed = [current[g][i] for g in range(len(dead)) for i in dead[g] if pool.ref_cnt[current[g][i]] == 1]
        available = pool.num_free_blocks + len(freed)
        if not held and any(r != rid for r in self.req_to_blocks):
            available -= self.watermark_blocks
        if sum(counts) + len(revived) > available:
            return None
        for h in hit:
            pool.touch(h)
        for g, d in enumerate(dead):
            pool.free_blocks([current[g][i] for i in d])
            for i in d:
                current[g][i] = NULL_BLOCK_ID
        fresh = pool.get_new_blocks(sum(counts))
        new, start = [], 0
        for n in counts:
            new.append(fresh[start:start + n])
            start += n
        self.req_to_blocks[rid] = [c + h + n for c, h, n in zip(current, hit, new)]
        if num_new_computed_tokens:
            self.num_cached[rid] = [len(h) for h in hit]
        if held is None and self.enable_caching:
            self.prefix_cache_stats.requests += 1
            self.prefix_cache_stats.queried_tokens += request.num_tokens
            self.prefix_cache_stats.hit_tokens += num_new_computed_tokens
        return tuple(new)

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        if isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, int) \
                or num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens={num_computed_tokens!r} must be an int >= 0")
        rid = request.request_id
        held = self.req_to_blocks.get(rid)
        if not self.enable_caching or held is None:
            return
        if num_computed_tokens > min([request.num_tokens] + [len(b) * s.block_size for b, s in zip(held, self.specs)]):
            raise ValueError("num_computed_tokens exceeds the request's tokens or slots")
        done = self.num_cached.setdefault(rid, [0] * len(self.specs))
        for g, blocks in enumerate(held):
            hashes = self.group_hashes(request, g)
            full = min(num_computed_tokens // self.specs[g].block_size, len(hashes))
            if full > done[g]:
                self.block_pool.cache_full_blocks(blocks, hashes, done[g], full)
                done[g] = full

    def free(self, request) -> None:
        rid = request if isinstance(request, str) else request.request_id
        for blocks in self.req_to_blocks.pop(rid, []):
            self.block_pool.free_blocks(list(reversed(blocks)))
        self.num_cached.pop(rid, None)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
