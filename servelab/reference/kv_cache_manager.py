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
"""

from __future__ import annotations

from collections.abc import Sequence

from servelab.blocks.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from servelab.reference.block_pool import NULL_BLOCK_ID, BlockPool


class KVCacheManager:
    """Reference manager for the built-in specs (full, MLA, sliding window, Mamba)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, enable_caching: bool = True, *,
                 max_model_len: int | None = None, watermark: float = 0.0) -> None:
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, MambaSpec)):
            raise ValueError(f"the reference manager does not model {type(spec).__name__}")
        if enable_caching and isinstance(spec, MambaSpec):
            raise ValueError("enable_caching=True is not supported for MambaSpec")
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_block_ids(self, request) -> list[int]:
        request_id = request if isinstance(request, str) else request.request_id
        return list(self.req_to_blocks.get(request_id, []))

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

    def get_computed_blocks(self, request) -> tuple[list[int], int]:
        if not self.enable_caching:
            return [], 0
        self.queried_tokens += request.num_tokens
        hashes = request.block_hashes
        longest = min(max(request.num_tokens - 1, 0) // self.block_size, len(hashes))
        for num_blocks in range(longest, -1, -1):
            visible = self._visible_blocks(num_blocks)
            if all(self.block_pool.get_cached_block(hashes[i]) is not None for i in visible):
                blocks = [self.block_pool.get_cached_block(hashes[i]) if i in visible else NULL_BLOCK_ID
                          for i in range(num_blocks)]
                self.hit_tokens += num_blocks * self.block_size
                return blocks, num_blocks * self.block_size
        return [], 0  # unreachable: zero blocks are always a valid hit

    def _dead(self, block_index: int, num_computed_tokens: int) -> bool:
        if not isinstance(self.spec, SlidingWindowSpec):
            return False
        last_token_in_block = (block_index + 1) * self.block_size - 1
        oldest_visible = num_computed_tokens - self.spec.sliding_window + 1
        return last_token_in_block < oldest_visible

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Sequence[int] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        rid = request.request_id
        hit = list(new_computed_blocks or [])
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

        if held is None:
            held = []
        elif not hit:
            for i in reversed(range(len(held))):
                if held[i] != NULL_BLOCK_ID and self._dead(i, request.num_computed_tokens):
                    self.block_pool.free_blocks([held[i]])
                    held[i] = NULL_BLOCK_ID

        num_new_blocks = max(0, self._blocks_for(slots) - len(held) - len(hit))
        revived = [b for b in hit if b != NULL_BLOCK_ID and self.block_pool.ref_cnt[b] == 0]
        available = self.block_pool.num_free_blocks
        others_hold_blocks = any(r != rid for r in self.req_to_blocks)
        if not held and others_hold_blocks:
            available -= self.watermark_blocks
        if num_new_blocks + len(revived) > available:
            return None

        self.block_pool.touch(hit)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        held = held + hit + new_blocks
        self.req_to_blocks[rid] = held
        if hit:
            self.num_cached[rid] = len(hit)
        if self.enable_caching:
            full = min(min(real_tokens, request.num_tokens) // self.block_size, len(request.block_hashes))
            done = self.num_cached.get(rid, 0)
            if full > done:
                self.block_pool.cache_full_blocks(held, request.block_hashes, done, full)
                self.num_cached[rid] = full
        return new_blocks

    def free(self, request) -> None:
        rid = request if isinstance(request, str) else request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self.num_cached.pop(rid, None)
        self.block_pool.free_blocks(list(reversed(blocks)))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
