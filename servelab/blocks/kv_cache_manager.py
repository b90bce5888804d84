"""``KVCacheManager``: the scheduler's view of KV memory.

The scheduler asks two questions per request and step:

1. On admission, ``get_computed_blocks(request)``: how much of this request's
   prefix is already cached? The answer is capped at ``num_tokens - 1``: the
   last token is always recomputed, because its logits are what the step is
   for.
2. ``allocate_slots(request, num_new_tokens, ...)``: make room for this step's
   tokens, or say ``None`` when they don't fit — nothing is allocated then, so
   the scheduler can preempt someone and retry without cleaning up.

A request's token positions, from the manager's point of view::

    | computed | new computed (prefix hit) | new (this step) | lookahead (drafts) |
    |<- already held ->|<-------------- allocated by this call ---------------->|

Full blocks are indexed for prefix caching as soon as they are allocated for
tokens the request really has (lookahead slots are never hashed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from servelab.blocks.block_pool import BlockPool
from servelab.blocks.free_queue import KVCacheBlock
from servelab.blocks.request import KVCacheRequest
from servelab.blocks.single_type import manager_class_for
from servelab.blocks.specs import KVCacheSpec, require_nonneg_int


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset, counted in tokens."""

    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def _request_id(request: object) -> str:
    try:
        request_id = request.request_id
        request.num_tokens, request.num_computed_tokens, request.block_hashes  # noqa: B018
    except AttributeError:
        raise TypeError(
            f"request must have request_id, num_tokens, num_computed_tokens and block_hashes "
            f"(see KVCacheRequest), got {type(request).__name__}"
        ) from None
    return request_id


class KVCacheManager:
    """Blocks of one KV-cache spec, shared by all requests.

    Args:
        spec: the cache kind (full attention, sliding window, MLA, Mamba...);
            its manager is looked up in the registry along the spec's MRO.
        num_blocks: pool size including the null block.
        enable_caching: reuse cached prefixes across requests.
        max_model_len: longest sequence a request may reach; slots past it
            (lookahead near the end) are not allocated. None: unbounded.
        watermark: fraction of usable blocks a request being *admitted* must
            leave free (when other requests hold blocks), so running requests
            can still grow without immediate preemption. In [0, 1).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        enable_caching: bool = True,
        *,
        max_model_len: int | None = None,
        watermark: float = 0.0,
    ) -> None:
        manager_cls = manager_class_for(spec)
        if enable_caching and not manager_cls.supports_prefix_caching:
            raise ValueError(
                f"enable_caching=True is not supported for {type(spec).__name__}: "
                f"{manager_cls.no_prefix_caching_reason}"
            )
        if max_model_len is not None and (
            isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len <= 0
        ):
            raise ValueError(f"max_model_len={max_model_len!r} must be a positive int or None")
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise ValueError(f"watermark={watermark!r} must be a number in [0, 1)")
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self._manager = manager_cls(spec, self.block_pool)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # ---- queries ---------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.block_pool.usage

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The blocks a request holds, in token order (empty if none)."""
        return list(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request: KVCacheRequest | str) -> list[int]:
        """Block ids of a request's block table row (0 = null block)."""
        request_id = request if isinstance(request, str) else request.request_id
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request``: its blocks (not yet
        referenced: pass them to ``allocate_slots``) and its length in tokens."""
        _request_id(request)
        if not self.enable_caching:
            return [], 0
        num_tokens = require_nonneg_int(request.num_tokens, "request.num_tokens")
        blocks = self._manager.find_longest_cache_hit(request.block_hashes, max(num_tokens - 1, 0))
        num_hit = len(blocks) * self.block_size
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queried_tokens += num_tokens
        stats.hit_tokens += num_hit
        return blocks, num_hit

    # ---- allocation --------------------------------------------------------

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Hold blocks for ``request.num_computed_tokens + num_new_computed_tokens
        + num_new_tokens + num_lookahead_tokens`` tokens.

        Args:
            num_new_tokens: tokens computed this step.
            num_new_computed_tokens: tokens covered by ``new_computed_blocks``
                (a prefix hit from ``get_computed_blocks``; admission only).
            new_computed_blocks: the hit's blocks; they gain a reference.
            num_lookahead_tokens: extra slots for speculative drafts; never hashed.

        Returns:
            The newly allocated blocks (possibly empty), or None if they don't
            fit — in which case nothing changed.
        """
        # This runs once per running request per step: checks are inlined for
        # the common case and fall back to the helpers for the error message.
        if type(num_new_tokens) is not int or num_new_tokens < 0:
            require_nonneg_int(num_new_tokens, "num_new_tokens")
        if type(num_new_computed_tokens) is not int or num_new_computed_tokens < 0:
            require_nonneg_int(num_new_computed_tokens, "num_new_computed_tokens")
        if type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0:
            require_nonneg_int(num_lookahead_tokens, "num_lookahead_tokens")
        request_id = _request_id(request)
        held = self.req_to_blocks.get(request_id)
        new_computed_blocks = list(new_computed_blocks) if new_computed_blocks else []
        if len(new_computed_blocks) * self.block_size != num_new_computed_tokens:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} must equal "
                f"len(new_computed_blocks) * block_size = {len(new_computed_blocks)} * {self.block_size}"
            )
        if new_computed_blocks and held:
            raise ValueError(
                f"new_computed_blocks given for request {request_id!r}, which already holds "
                f"{len(held)} blocks; prefix hits apply on admission only"
            )
        request_computed = request.num_computed_tokens
        if type(request_computed) is not int or request_computed < 0:
            require_nonneg_int(request_computed, "request.num_computed_tokens")
        num_real_tokens = request_computed + num_new_computed_tokens + num_new_tokens
        num_slots = num_real_tokens + num_lookahead_tokens
        if self.max_model_len is not None:
            if num_real_tokens > self.max_model_len:
                raise ValueError(
                    f"request {request_id!r} would reach {num_real_tokens} tokens, over "
                    f"max_model_len={self.max_model_len}"
                )
            num_slots = min(num_slots, self.max_model_len)

        manager = self._manager
        if held is None:
            held = []
        elif not new_computed_blocks and manager.releases_blocks:
            # Free out-of-window blocks first, so they count as free below.
            released = manager.release_skipped_blocks(held, request_computed)
            if released:
                self.block_pool.free_blocks(released)

        num_to_allocate = manager.num_required_blocks(num_slots) - len(held) - len(new_computed_blocks)
        if num_to_allocate > 0 or new_computed_blocks or not held:
            # Hit blocks sitting in the free queue leave it when touched.
            num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
            budget = self.block_pool.num_free_blocks
            if not held and self.req_to_blocks.keys() - {request_id}:
                budget -= self.watermark_blocks
            if max(num_to_allocate, 0) + num_revived > budget:
                return None
            if new_computed_blocks:
                self.block_pool.touch(new_computed_blocks)
                held.extend(new_computed_blocks)
                self._num_cached_blocks[request_id] = len(new_computed_blocks)
        if num_to_allocate > 0:
            new_blocks = self.block_pool.get_new_blocks(num_to_allocate)
            held.extend(new_blocks)
        else:
            new_blocks = []
        self.req_to_blocks[request_id] = held

        if self.enable_caching:
            num_full = min(num_real_tokens, request.num_tokens) // self.block_size
            num_cached = self._num_cached_blocks.get(request_id, 0)
            if num_full > num_cached:
                hashes = request.block_hashes
                num_full = min(num_full, len(hashes))
                if num_full > num_cached:
                    self.block_pool.cache_full_blocks(held, hashes, num_cached, num_full)
                    self._num_cached_blocks[request_id] = num_full
        return new_blocks

    def free(self, request: KVCacheRequest | str) -> None:
        """Release every block of a request, tail first. Idempotent: freeing a
        request that holds nothing does nothing."""
        request_id = request if isinstance(request, str) else request.request_id
        blocks = self.req_to_blocks.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while requests hold blocks."""
        return self.block_pool.reset_prefix_cache()
