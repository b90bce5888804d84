"""``KVCacheManager``: the scheduler's view of KV memory.

The scheduler asks three things per request (see
:class:`~servelab.blocks.interfaces.KVCacheManagerProtocol` for the contract):

1. On admission, ``get_computed_blocks(request)``: how much of this request's
   prefix is already cached? The answer is capped at ``num_tokens - 1``: the
   last token is always recomputed, because its logits are what the step is
   for.
2. ``allocate_slots(request, num_new_tokens, ...)``: make room for this step's
   tokens, or say ``None`` when they don't fit — nothing changed then, so
   the scheduler can preempt someone and retry without cleaning up.
3. After the step, ``cache_blocks(request, request.num_computed_tokens)``:
   the KV of those tokens is now written; make their full blocks findable.

A request's token positions, from the manager's point of view::

    | computed | new computed (prefix hit) | new (this step) | lookahead (drafts) |
    |<- already held ->|<-------------- allocated by this call ---------------->|

**Commit after compute.** A block becomes findable by prefix lookup only
after the step that writes its KV has succeeded: ``allocate_slots`` never
indexes anything, ``cache_blocks`` does, and only for tokens the caller says
are computed (after rejected drafts are subtracted; lookahead slots never).
A step that fails, is interrupted, or a request preempted in the same
``schedule()`` call, leaves no uncomputed block findable.

**Atomic.** Each public method validates everything before changing state:
an exception (or ``None`` from ``allocate_slots``) leaves no trace.

**Stats** (``prefix_cache_stats``) count each request once per admission, when
``allocate_slots`` admits it (vLLM semantics), not on every lookup while it
waits for memory.

**Per-group shapes.** One manager is one KV-cache group, and it answers in
the shape every manager shares (vLLM's coordinator's): ``get_block_ids``
returns a 1-tuple ``([ids...],)`` and ``allocate_slots`` a 1-tuple of the new
blocks ``([blocks...],)`` (see
:class:`~servelab.blocks.interfaces.KVCacheManagerProtocol`).

**One owner.** The manager owns its pool (a :class:`BlockPool` built from
``num_blocks`` / ``eviction_policy``, or any object conforming to
:class:`~servelab.blocks.interfaces.BlockPoolProtocol` injected with
``block_pool=``);
the per-spec helper it uses is rebuilt with it, so there is no second,
stale reference. ``manager.block_pool = other`` works while no request holds
blocks and raises otherwise.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from servelab._internal.conformance import check_conforms
from servelab._internal.validation import check_bool, check_int, check_number
from servelab.blocks.block_pool import BlockPool
from servelab.blocks.events import KVEventPublisher, KVEventSource, KVEventSubscriber, event_fields, make_publisher
from servelab.blocks.free_queue import KVCacheBlock
from servelab.blocks.interfaces import BlockPoolProtocol, EvictionPolicy
from servelab.blocks.request import KVCacheRequest
from servelab.blocks.single_type import SingleTypeManager, manager_class_for
from servelab.blocks.specs import KVCacheSpec
from servelab.blocks.stats import PrefixCacheStats


def _request_id(request: Any) -> str:
    try:
        request_id = request.request_id
        request.num_tokens, request.num_computed_tokens, request.block_hashes  # noqa: B018
    except AttributeError:
        raise TypeError(
            f"request must have request_id, num_tokens, num_computed_tokens and block_hashes "
            f"(see KVCacheRequest), got {type(request).__name__}"
        ) from None
    return request_id


class KVCacheManager(KVEventSource):
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
        eviction_policy: for the pool built here: a registered name
            (default ``"lru"``) or an :class:`EvictionPolicy` object.
        block_pool: a ready pool to use instead: any object conforming to
            :class:`~servelab.blocks.interfaces.BlockPoolProtocol` whose blocks
            are ``KVCacheBlock`` objects (a :class:`BlockPool`, a subclass, or
            a class wrapping one). It must have ``num_blocks`` blocks and the
            same ``enable_caching``, hold no blocks and belong to no other
            manager. Its eviction policy is its own (``eviction_policy`` must
            then be left None). KV events need a pool with a
            ``kv_event_publisher`` attribute (``BlockPool`` has one).
        kv_events: publish KV-cache events (:mod:`servelab.blocks.events`):
            ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, batched
            per step by :meth:`publish_kv_events`. Off by default (zero cost).
        kv_event_subscribers: a callable ``f(batch)`` or several; giving one
            turns events on. More can be added with :meth:`subscribe_kv_events`.
    """

    _pool: BlockPoolProtocol

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        enable_caching: bool = True,
        *,
        max_model_len: int | None = None,
        watermark: float = 0.0,
        eviction_policy: str | EvictionPolicy | None = None,
        block_pool: BlockPoolProtocol | None = None,
        kv_events: bool = False,
        kv_event_subscribers: Iterable[KVEventSubscriber] | KVEventSubscriber | None = None,
    ) -> None:
        manager_cls = manager_class_for(spec)
        publisher = make_publisher(kv_events, kv_event_subscribers)
        check_bool("enable_caching", enable_caching)
        if enable_caching and not manager_cls.supports_prefix_caching:
            raise ValueError(
                f"enable_caching=True is not supported for {type(spec).__name__}: "
                f"{manager_cls.no_prefix_caching_reason}"
            )
        if max_model_len is not None:
            check_int("max_model_len", max_model_len, min_value=1)
        check_number("watermark", watermark, min_value=0.0, max_value=1.0, max_exclusive=True)
        check_int("num_blocks", num_blocks)
        if block_pool is None:
            block_pool = BlockPool(num_blocks, enable_caching,
                                   eviction_policy="lru" if eviction_policy is None else eviction_policy)
        elif eviction_policy is not None:
            raise ValueError("eviction_policy applies to the pool the manager builds; with block_pool= "
                             "give the policy to that BlockPool instead")
        self.spec = spec
        self.block_size = spec.block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self._take_pool(block_pool, num_blocks, manager_cls, publisher)

    # ---- the pool ----------------------------------------------------------

    @property
    def block_pool(self) -> BlockPoolProtocol:
        """The pool this manager owns. Assignable while no request holds blocks."""
        return self._pool

    @block_pool.setter
    def block_pool(self, pool: BlockPoolProtocol) -> None:
        if self.req_to_blocks:
            raise ValueError(f"cannot replace block_pool while {len(self.req_to_blocks)} requests hold blocks "
                             "of the current one; free them first")
        self._take_pool(pool, self._pool.num_blocks, type(self._manager))
        self._num_cached_blocks.clear()

    def _take_pool(self, pool: BlockPoolProtocol, num_blocks: int, manager_cls: type,
                   publisher: KVEventPublisher | None = None) -> None:
        """Validate ``pool`` fully, then become its only owner (the KV events, ``publisher`` or
        the current pool's, follow the manager)."""
        check_conforms(pool, BlockPoolProtocol, "block_pool")
        if not isinstance(pool.null_block, KVCacheBlock):
            raise TypeError(f"block_pool ({type(pool).__name__}) hands out {type(pool.null_block).__name__} "
                            "blocks; this manager needs KVCacheBlock objects (the reference pool, whose blocks "
                            "are ints: the reference pool pairs with servelab.reference.KVCacheManager)")
        if pool.num_blocks != num_blocks:
            raise ValueError(f"block_pool has num_blocks={pool.num_blocks}, the manager needs {num_blocks} "
                             "(the KV tensors are sized for it)")
        if pool.enable_caching != self.enable_caching:
            raise ValueError(f"block_pool.enable_caching={pool.enable_caching} differs from the manager's "
                             f"enable_caching={self.enable_caching}")
        old: BlockPoolProtocol | None = getattr(self, "_pool", None)  # None: the constructor's first pool
        if pool is old:
            return
        owner = getattr(pool, "_owner", None)
        if owner is not None and owner() is not None:
            raise ValueError("block_pool already belongs to another KVCacheManager; one pool has one owner")
        if pool.num_free_blocks != pool.num_blocks - 1:
            raise ValueError(f"block_pool has {pool.num_blocks - 1 - pool.num_free_blocks} blocks held; "
                             "a pool is handed over with every block free")
        if old is not None:
            publisher = getattr(old, "kv_event_publisher", None)
        if publisher is not None and not hasattr(pool, "kv_event_publisher"):
            raise ValueError(f"block_pool ({type(pool).__name__}) has no kv_event_publisher attribute, so it "
                             "cannot publish this manager's KV events (servelab.blocks.BlockPool can)")
        if old is not None:
            old._owner = None  # type: ignore[attr-defined]
            if publisher is not None:
                old.kv_event_publisher = None  # type: ignore[attr-defined]
        if publisher is not None:
            pool.kv_event_publisher = publisher  # type: ignore[attr-defined]
        pool._owner = weakref.ref(self)  # type: ignore[attr-defined]
        self._pool = pool
        self._manager = manager_cls(self.spec, pool)

    # ---- queries ---------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Pool size, null block included."""
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self._pool.usage

    @property
    def held_blocks_cover_slots(self) -> bool:
        """True when ``b`` held blocks always hold ``b * block_size`` token slots and a request's
        blocks never shrink while it runs (full attention, MLA: no sliding-window release, the
        plain block count). Then ``allocate_slots`` for slots the held blocks already cover changes
        nothing, and a caller (the scheduler's decode hot path) may skip the call."""
        manager = self._manager
        return (not manager.releases_blocks
                and type(manager).num_required_blocks is SingleTypeManager.num_required_blocks)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The blocks a request holds, in token order (empty if none)."""
        return list(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request: KVCacheRequest | str) -> tuple[list[int]]:
        """The request's block-table row as a 1-tuple (one KV-cache group):
        ``([id, ...],)`` in token order, 0 = null block; ``([],)`` when it holds nothing."""
        request_id = request if isinstance(request, str) else request.request_id
        return ([b.block_id for b in self.req_to_blocks.get(request_id, ())],)

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[tuple[list[KVCacheBlock]], int]:
        """Longest cached prefix of ``request``: its blocks per KV-cache group
        (``([block, ...],)``: one group; not yet referenced: pass them to
        ``allocate_slots``) and its length in tokens. No side effect (stats are
        counted when ``allocate_slots`` admits)."""
        _request_id(request)
        if not self.enable_caching:
            return ([],), 0
        num_tokens = check_int("request.num_tokens", request.num_tokens, min_value=0)
        blocks = self._manager.find_longest_cache_hit(request.block_hashes, max(num_tokens - 1, 0))
        return (blocks,), len(blocks) * self.block_size

    # ---- allocation --------------------------------------------------------

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock]] | None:
        """Hold blocks for ``request.num_computed_tokens + num_new_computed_tokens
        + num_new_tokens + num_lookahead_tokens`` tokens. Never indexes a block
        (``cache_blocks`` does, once the KV is written).

        Args:
            num_new_tokens: tokens computed this step.
            num_new_computed_tokens: tokens covered by ``new_computed_blocks``
                (a prefix hit from ``get_computed_blocks``; admission only).
            new_computed_blocks: the hit's blocks; they gain a reference.
            num_lookahead_tokens: extra slots for speculative drafts.

        Returns:
            The newly allocated blocks as a 1-tuple (one KV-cache group; the
            list may be empty), or None if they don't fit — in which case
            nothing changed.
        """
        # Step 1: validate everything (inline checks for the per-step common case).
        if type(num_new_tokens) is not int or num_new_tokens < 0:
            check_int("num_new_tokens", num_new_tokens, min_value=0)
        if type(num_new_computed_tokens) is not int or num_new_computed_tokens < 0:
            check_int("num_new_computed_tokens", num_new_computed_tokens, min_value=0)
        if type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0:
            check_int("num_lookahead_tokens", num_lookahead_tokens, min_value=0)
        if not num_new_computed_tokens and new_computed_blocks is None and not self._manager.releases_blocks:
            # Fast path (most decode steps): the held blocks already have every slot.
            held = self.req_to_blocks.get(getattr(request, "request_id", None))  # type: ignore[arg-type]
            computed = getattr(request, "num_computed_tokens", None)
            if held and type(computed) is int and computed >= 0:
                num_slots = computed + num_new_tokens
                max_len = self.max_model_len
                if max_len is None or num_slots <= max_len:  # else the full path raises
                    num_slots += num_lookahead_tokens
                    if max_len is not None and num_slots > max_len:
                        num_slots = max_len
                    if num_slots <= len(held) * self.block_size:
                        return ([],)
        request_id = _request_id(request)
        held = self.req_to_blocks.get(request_id)
        hit = self._check_hit(request_id, held, num_new_computed_tokens, new_computed_blocks)
        request_computed = request.num_computed_tokens
        if type(request_computed) is not int or request_computed < 0:
            check_int("request.num_computed_tokens", request_computed, min_value=0)
        num_slots = self._num_slots(request_id, request_computed + num_new_computed_tokens + num_new_tokens,
                                    num_lookahead_tokens)

        # Step 2: plan — what would be released, how many blocks are needed.
        manager = self._manager
        plan, released = held, ()
        if held and not hit and manager.releases_blocks:
            plan = held.copy()
            released = manager.release_skipped_blocks(plan, request_computed)
        num_held = len(held) if held else 0
        num_to_allocate = manager.num_required_blocks(num_slots) - num_held - len(hit)
        if (num_to_allocate > 0 or hit or not held) and not self._fits(
                request_id, held, hit, released, max(num_to_allocate, 0)):
            return None

        # Step 3: commit.
        new_blocks = self._commit(request_id, held, plan, hit, released, num_to_allocate)
        if held is None and self.enable_caching:
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queried_tokens += request.num_tokens
            stats.hit_tokens += num_new_computed_tokens
        return (new_blocks,)

    def _check_hit(self, request_id: str, held: list[KVCacheBlock] | None, num_new_computed_tokens: int,
                   new_computed_blocks: tuple[Sequence[KVCacheBlock], ...] | None) -> list[KVCacheBlock]:
        if new_computed_blocks is None:
            hit = []
        elif type(new_computed_blocks) is tuple and len(new_computed_blocks) == 1:
            hit = list(new_computed_blocks[0])
        else:
            raise TypeError(f"new_computed_blocks must be None or a per-group tuple with this manager's one "
                            f"group, ([block, ...],), as get_computed_blocks returns; got a "
                            f"{type(new_computed_blocks).__name__}")
        if len(hit) * self.block_size != num_new_computed_tokens:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} must equal "
                f"len(new_computed_blocks) * block_size = {len(hit)} * {self.block_size}"
            )
        if hit:
            if held:
                raise ValueError(
                    f"new_computed_blocks given for request {request_id!r}, which already holds "
                    f"{len(held)} blocks; prefix hits apply on admission only"
                )
        return hit  # checked to be this pool's blocks by touch(), the first change _commit makes

    def _num_slots(self, request_id: str, num_real_tokens: int, num_lookahead_tokens: int) -> int:
        """Slots to hold: real tokens (must fit max_model_len) plus lookahead (clipped)."""
        num_slots = num_real_tokens + num_lookahead_tokens
        if self.max_model_len is not None:
            if num_real_tokens > self.max_model_len:
                raise ValueError(
                    f"request {request_id!r} would reach {num_real_tokens} tokens, over "
                    f"max_model_len={self.max_model_len}"
                )
            num_slots = min(num_slots, self.max_model_len)
        return num_slots

    def _fits(self, request_id: str, held: list[KVCacheBlock] | None, hit: list[KVCacheBlock],
              released: Sequence[KVCacheBlock], num_to_allocate: int) -> bool:
        """Whether ``num_to_allocate`` new blocks plus the hit's free blocks fit
        in the free blocks (plus those ``released`` would free), minus the
        watermark when admitting next to others."""
        # Hit blocks sitting free leave the free set when touched.
        try:
            num_revived = sum(1 for b in hit if b.ref_cnt == 0 and not b.is_null)
        except AttributeError:
            raise TypeError(f"new_computed_blocks must hold KVCacheBlock objects, got "
                            f"{sorted({type(b).__name__ for b in hit})}") from None
        budget = self._pool.num_free_blocks + sum(1 for b in released if b.ref_cnt == 1)
        if not held and self.req_to_blocks.keys() - {request_id}:
            budget -= self.watermark_blocks
        return num_to_allocate + num_revived <= budget

    def _commit(self, request_id: str, held: list[KVCacheBlock] | None, plan: list[KVCacheBlock] | None,
                hit: list[KVCacheBlock], released: Sequence[KVCacheBlock],
                num_to_allocate: int) -> list[KVCacheBlock]:
        pool = self._pool
        if hit:
            pool.touch(hit)
        if released:  # out-of-window blocks first, so their room is reused now
            pool.free_blocks(released)
        try:
            new_blocks = pool.get_new_blocks(num_to_allocate) if num_to_allocate > 0 else []
        except BaseException:  # a raising eviction policy: undo the release and the touch
            if released:
                pool.touch(released)
            if hit:
                pool.free_blocks(hit[::-1])
            raise
        if held is None:
            held = hit + new_blocks
            self.req_to_blocks[request_id] = held
            if hit:
                self._num_cached_blocks[request_id] = len(hit)
            return new_blocks
        if released and plan is not None:
            held[:] = plan
        if new_blocks:
            held.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """Make the request's full blocks covering its first
        ``num_computed_tokens`` tokens findable by prefix lookup.

        Call it once the KV of those tokens is written (the scheduler does, in
        ``update_from_output``, with ``request.num_computed_tokens`` after
        rejected drafts are subtracted). Incremental (only blocks not cached
        yet are indexed) and idempotent; a no-op with caching off or for a
        request that holds no blocks (finished, preempted, never admitted).
        Raises ValueError, changing nothing, if ``num_computed_tokens`` exceeds
        the request's tokens or its allocated slots.
        """
        if type(num_computed_tokens) is not int or num_computed_tokens < 0:
            check_int("num_computed_tokens", num_computed_tokens, min_value=0)
        if not self.enable_caching:
            return
        try:
            request_id = request.request_id
        except AttributeError:
            request_id = _request_id(request)
        held = self.req_to_blocks.get(request_id)
        if not held:
            return
        block_size = self.block_size
        if num_computed_tokens > len(held) * block_size or num_computed_tokens > request.num_tokens:
            self._cache_blocks_error(request, num_computed_tokens, held)
        num_full = num_computed_tokens // block_size
        num_cached = self._num_cached_blocks.get(request_id, 0)
        if num_full > num_cached:
            hashes = request.block_hashes
            num_full = min(num_full, len(hashes))
            if num_full > num_cached:
                pool = self._pool
                if getattr(pool, "kv_event_publisher", None) is None:
                    pool.cache_full_blocks(held, hashes, num_cached, num_full)
                else:
                    pool.cache_full_blocks(held, hashes, num_cached, num_full, *event_fields(request, block_size))
                self._num_cached_blocks[request_id] = num_full

    def _cache_blocks_error(self, request: KVCacheRequest, num_computed_tokens: int,
                            held: list[KVCacheBlock]) -> None:
        raise ValueError(
            f"num_computed_tokens={num_computed_tokens} exceeds request {request.request_id!r}'s "
            f"{request.num_tokens} tokens or its {len(held) * self.block_size} allocated slots; only "
            "tokens whose KV was written can be cached"
        )

    def free(self, request: KVCacheRequest | str) -> None:
        """Release every block of a request, tail first. Idempotent: freeing a
        request that holds nothing does nothing."""
        request_id = request if isinstance(request, str) else request.request_id
        blocks = self.req_to_blocks.get(request_id)
        if blocks:
            self._pool.free_blocks(blocks[::-1])
        self.req_to_blocks.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while requests hold blocks."""
        return self._pool.reset_prefix_cache()
