"""``BlockPool``: the physical KV blocks, their reference counts, the free
blocks and the prefix-cache index.

Life of a block::

    free and empty --get_new_blocks--> owned (ref_cnt >= 1)
    owned --cache_full_blocks--> owned and indexed (findable by prefix lookup)
    owned --free_blocks, ref_cnt reaches 0--> free again
        empty (not indexed): to the head of the pool's free queue (handed out next)
        indexed:             to the eviction policy (evictable, still findable)
    free and indexed --get_cached_block + touch--> owned again (a prefix hit)
    free and indexed --evicted by get_new_blocks--> hash dropped, handed out

**Commit after compute.** A block becomes findable by prefix lookup only after
the step that writes its KV has succeeded: ``cache_full_blocks`` is called by
``KVCacheManager.cache_blocks``, which the scheduler calls after the step,
never at allocation. A failed step, or a request preempted in the step that
scheduled it, leaves nothing uncomputed findable.

**Eviction is a policy** (:mod:`servelab.blocks.eviction`). The pool keeps the
free *empty* blocks itself, in an intrusive O(1) queue, and hands them out
first (their content is worthless); the :class:`EvictionPolicy` holds the free
*indexed* blocks and chooses which ones to evict when the empty ones run out.
With the default ``"lru"`` policy (itself a free queue) the hand-out order is
exactly the single free queue of vLLM: empty blocks most recently freed first,
then cached blocks least recently freed first.

**Atomic operations.** Every public method validates its whole argument before
changing anything (``free_blocks([a, b])`` with ``b`` already free raises and
``a`` keeps its reference). What is undone if a user-written policy raises
mid-operation: reference counts and free-set membership (the policy's own
order may differ afterwards).

Block 0 is the *null block*: never handed out, never freed, its reference
count untouched. Block tables use it as a placeholder (padding rows, sliding-
window positions whose blocks were released).

Decision (differs from vLLM): when a second block is cached under a hash that
already maps to a block, the second one is *not* indexed. It stays empty and
returns to the queue's head when freed, so duplicates never take cache space
from distinct content, and ``get_cached_block`` has exactly one answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from servelab._internal.validation import check_bool, check_int
from servelab.blocks.events import KVEventPublisher
from servelab.blocks.eviction import LRUEvictionPolicy, get_eviction_policy
from servelab.blocks.free_queue import FreeBlockQueue, KVCacheBlock
from servelab.blocks.hashing import BlockHash
from servelab.blocks.interfaces import EvictionPolicy

NULL_BLOCK_ID = 0


class BlockPool:
    """All ``num_blocks`` KV blocks of one cache (block 0 is the null block).

    Args:
        num_blocks: total blocks including the null block; at least 2.
        enable_caching: index full blocks by hash for prefix caching. When
            False, ``cache_full_blocks`` is a no-op and no block is ever hashed.
        eviction_policy: a registered name (``available_eviction_policies()``:
            ``"lru"`` default, ``"lfu"``, ``"fewest_descendants"``) or an
            :class:`EvictionPolicy` object not used by another pool.

    Attributes:
        blocks: every ``KVCacheBlock``, indexed by block id.
        free_queue: the free blocks that hold no indexed content, head first.
        eviction_policy: the policy object holding the free indexed blocks.
        cached_block_hash_to_block: the prefix-cache index.
        num_evictions: indexed blocks reused for new content so far.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, *,
                 eviction_policy: str | EvictionPolicy = "lru") -> None:
        check_int("num_blocks", num_blocks)
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
        check_bool("enable_caching", enable_caching)
        policy = get_eviction_policy(eviction_policy)
        if len(policy):
            raise ValueError(f"eviction_policy {policy.name!r} already holds {len(policy)} blocks: "
                             "one policy object serves one pool; pass a new one or a name")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.is_null = True
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.eviction_policy = policy
        # The built-in LRU policy (a free queue): touch/free link its blocks inline (same order as its methods).
        self._lru = policy if type(policy) is LRUEvictionPolicy else None
        # Optional hooks, looked up once: policies without them cost nothing.
        self._on_cached = getattr(policy, "on_cached", None)
        self._on_hit = getattr(policy, "on_hit", None)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        self.evict_listeners: list = []
        """Called as ``fn(blocks)`` with the indexed blocks being evicted, before their
        hashes are dropped and before the caller writes them (a KV connector saves them)."""
        self.cache_listeners: list = []
        """Called as ``fn(blocks)`` with the blocks ``cache_full_blocks`` just indexed."""
        # KV-cache events (servelab.blocks.events): None = off, nothing recorded.
        self.kv_event_publisher: KVEventPublisher | None = None

    # ---- allocation -----------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out now (evictable cached ones included)."""
        return self.free_queue._len + len(self.eviction_policy)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by requests."""
        return 1.0 - (self.free_queue._len + len(self.eviction_policy)) / (self.num_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """``num_blocks`` blocks with ``ref_cnt == 1``: empty ones from the head
        of the free queue first, then cached ones chosen by the eviction
        policy (their hashes are dropped: evicted)."""
        if type(num_blocks) is not int or num_blocks < 0:
            check_int("num_blocks", num_blocks, min_value=0)
        queue = self.free_queue
        # One block (a decode crossing a block boundary): no loop. (The head's successor is never None,
        # the queue has a tail sentinel; the test only narrows the type.)
        if num_blocks == 1 and queue._len and (node := (head := queue._head).next_free) is not None:
            head.next_free = nxt = node.next_free
            nxt.prev_free = head
            node.prev_free = node.next_free = None
            node.ref_cnt = 1
            queue._len -= 1
            return [node]
        if num_blocks > queue._len:
            blocks = self._get_with_eviction(num_blocks)
            for block in blocks:
                block.ref_cnt = 1
            return blocks
        # The free queue's popleft_n, inlined, taking the reference in the same pass.
        blocks = []
        head = queue._head
        node = head.next_free
        for _ in range(num_blocks):
            nxt = node.next_free
            node.prev_free = node.next_free = None
            node.ref_cnt = 1
            blocks.append(node)
            node = nxt
        head.next_free = node
        node.prev_free = head
        queue._len -= num_blocks
        return blocks

    def _get_with_eviction(self, num_blocks: int) -> list[KVCacheBlock]:
        queue, policy = self.free_queue, self.eviction_policy
        num_evict = num_blocks - queue._len
        if num_evict > len(policy):
            raise ValueError(f"num_blocks={num_blocks} exceeds the {queue._len + len(policy)} free blocks; "
                             "ask for at most num_free_blocks")
        victims = list(policy.evict(num_evict))  # a raising policy leaves the pool unchanged
        mine = self.blocks
        for block in victims:
            if (not isinstance(block, KVCacheBlock) or mine[block.block_id] is not block
                    or block.ref_cnt != 0 or block.block_hash is None):
                raise RuntimeError(f"eviction policy {policy.name!r} returned {block!r}, which is not one of "
                                   "its evictable blocks; the policy is broken")
        if len(victims) != num_evict:
            raise RuntimeError(f"eviction policy {policy.name!r} returned {len(victims)} blocks for "
                               f"evict({num_evict})")
        for listener in self.evict_listeners:
            listener(victims)
        blocks = queue.popleft_n(queue._len)
        index = self.cached_block_hash_to_block
        publisher = self.kv_event_publisher
        if publisher is not None:
            publisher.removed([block.block_hash for block in victims])
        for block in victims:
            del index[block.block_hash]
            block.block_hash = None
        self.num_evictions += num_evict
        blocks += victims
        return blocks

    def _own(self, blocks: Iterable[KVCacheBlock], name: str, held: bool = False) -> list[KVCacheBlock]:
        """``blocks`` as a list, checked to be this pool's blocks (and, with
        ``held``, to be referenced or null) before any state changes, so a bad
        argument never leaves the pool half-updated."""
        if type(blocks) is not list:
            blocks = list(blocks)
        mine = self.blocks
        try:
            if held:
                for b in blocks:
                    if mine[b.block_id] is not b or b.ref_cnt <= 0:
                        self._check_held(b, name)
            else:
                for b in blocks:
                    if mine[b.block_id] is not b:
                        raise ValueError(f"{name} contains {b!r}, which belongs to another pool")
        except (AttributeError, IndexError, TypeError):
            kinds = sorted({type(b).__name__ for b in blocks})
            raise TypeError(f"{name} must contain this pool's KVCacheBlock objects, got {kinds}") from None
        return blocks

    def _check_held(self, block: KVCacheBlock, name: str) -> None:
        if self.blocks[block.block_id] is not block:
            raise ValueError(f"{name} contains {block!r}, which belongs to another pool")
        if not block.is_null:
            raise ValueError(f"block {block.block_id} is already free (ref_cnt={block.ref_cnt}); "
                             "each reference may be freed once")

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order; blocks that
        reach zero become free (empty ones to the queue's head, cached ones to
        the eviction policy). Callers free a request's blocks tail-first, so
        that among blocks freed together the end of a hash chain is evicted
        (by LRU) before its more shareable prefix.

        Raises ValueError, changing nothing, if a block is already free or is
        listed more often than it is referenced."""
        lru = self._lru
        if lru is None:
            return self._free_to_policy(blocks)
        # The built-in LRU policy (the hot path, kept in one frame): the check of _own(held=True) and
        # the queue links inlined (empty blocks to the free queue's head, cached ones to the LRU tail).
        if type(blocks) is not list:
            blocks = list(blocks)
        mine = self.blocks
        try:
            for b in blocks:
                if mine[b.block_id] is not b or b.ref_cnt <= 0:
                    self._check_held(b, "blocks")
        except (AttributeError, IndexError, TypeError):
            self._own(blocks, "blocks", held=True)  # raises the TypeError naming the argument
        queue = self.free_queue
        head, tail = queue._head, lru._tail
        num_empty = num_cached = 0
        for k, block in enumerate(blocks):
            ref = block.ref_cnt
            if ref > 1:
                block.ref_cnt = ref - 1
                continue
            if block.is_null:
                continue
            if ref <= 0:  # listed more often than referenced
                queue._len += num_empty
                lru._len += num_cached
                self._undo_free(blocks[:k])
                raise ValueError(f"block {block.block_id} is listed more times than it is referenced; "
                                 "each reference may be freed once")
            block.ref_cnt = 0
            if block.block_hash is None:
                first = head.next_free
                block.prev_free, block.next_free = head, first
                head.next_free = first.prev_free = block
                num_empty += 1
            else:
                last = tail.prev_free
                block.prev_free, block.next_free = last, tail
                last.next_free = tail.prev_free = block
                num_cached += 1
        queue._len += num_empty
        lru._len += num_cached

    def _free_to_policy(self, blocks: Iterable[KVCacheBlock]) -> None:
        """``free_blocks`` with any other eviction policy: cached blocks go to its ``push``."""
        blocks = self._own(blocks, "blocks", held=True)
        queue, push = self.free_queue, self.eviction_policy.push
        it = iter(blocks)  # what is left of it tells how far an undo must go
        for block in it:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:  # listed more often than referenced
                self._undo_free(blocks[: len(blocks) - len(list(it)) - 1])
                raise ValueError(f"block {block.block_id} is listed more times than it is referenced; "
                                 "each reference may be freed once")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    try:
                        push(block)
                    except BaseException:
                        block.ref_cnt = 1
                        self._undo_free(blocks[: len(blocks) - len(list(it)) - 1])
                        raise

    def _undo_free(self, done: list[KVCacheBlock]) -> None:
        """Give back the references ``free_blocks`` dropped from ``done``
        (newest first, so the free queue's links come back exactly)."""
        queue, policy = self.free_queue, self.eviction_policy
        for block in reversed(done):
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.remove(block)
                else:
                    policy.remove(block)
            block.ref_cnt += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit), taking free
        ones out of the free set so they cannot be evicted while in use."""
        blocks = self._own(blocks, "blocks")
        if self._lru is not None:
            return self._touch_lru(blocks)
        queue, policy = self.free_queue, self.eviction_policy
        it = iter(blocks)
        try:
            for block in it:
                if block.is_null:
                    continue
                if block.ref_cnt == 0:
                    if block.block_hash is None:
                        queue.remove(block)
                    else:
                        policy.remove(block)
                block.ref_cnt += 1
        except BaseException:  # only a user policy's remove() can raise here
            done = blocks[: len(blocks) - len(list(it)) - 1]
            for block in reversed(done):
                if not block.is_null:
                    block.ref_cnt -= 1
                    if block.ref_cnt == 0:
                        self._make_free(block)
            raise
        on_hit = self._on_hit
        if on_hit is not None:
            for block in blocks:
                if block.block_hash is not None and not block.is_null:
                    on_hit(block)

    def _touch_lru(self, blocks: list[KVCacheBlock]) -> None:
        """``touch`` with the built-in LRU policy: free blocks unlinked inline
        (the null block, always at ref_cnt 0, is skipped)."""
        num_empty = num_cached = 0
        for block in blocks:
            ref = block.ref_cnt
            if ref == 0:
                if block.is_null:
                    continue
                prev, nxt = block.prev_free, block.next_free
                prev.next_free, nxt.prev_free = nxt, prev
                block.prev_free = block.next_free = None
                if block.block_hash is None:
                    num_empty += 1
                else:
                    num_cached += 1
            block.ref_cnt = ref + 1
        self.free_queue._len -= num_empty
        self._lru._len -= num_cached

    def _make_free(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            self.free_queue.appendleft(block)
        else:
            self.eviction_policy.push(block)

    # ---- prefix cache ---------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding content with this hash, or None."""
        try:
            return self.cached_block_hash_to_block.get(block_hash)
        except TypeError:  # unhashable: a list of tokens instead of a block hash
            raise TypeError(f"block_hash must be bytes, got {type(block_hash).__name__}") from None

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] | None = None,
        block_size: int | None = None,
        lora_name: str | None = None,
        group_idx: int | None = None,
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]`` under
        ``block_hashes`` at the same positions.

        ``token_ids`` (the request's tokens), ``block_size``, ``lora_name`` and
        ``group_idx`` are read only when KV events are on
        (``kv_event_publisher``): they fill the ``BlockStored`` event of the
        blocks this call makes findable.

        ``blocks`` and ``block_hashes`` are one request's block list and hash
        list (position i of both covers tokens ``[i*bs, (i+1)*bs)``); the
        blocks in the range must be held (their KV was just written). Null
        blocks are skipped; a hash already indexed keeps its first block.
        """
        if type(blocks) is not list:
            blocks = list(blocks)
        check_int("num_cached_blocks", num_cached_blocks, min_value=0)
        check_int("num_full_blocks", num_full_blocks, min_value=0)
        if num_cached_blocks > num_full_blocks:
            raise ValueError(
                f"num_cached_blocks={num_cached_blocks} must be <= num_full_blocks={num_full_blocks}"
            )
        if num_full_blocks > len(blocks) or num_full_blocks > len(block_hashes):
            raise ValueError(
                f"num_full_blocks={num_full_blocks} exceeds len(blocks)={len(blocks)} "
                f"or len(block_hashes)={len(block_hashes)}"
            )
        # Only the range is checked: a long request caches a block at a time (O(range), not O(len)).
        self._own(blocks[num_cached_blocks:num_full_blocks], "blocks")
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.ref_cnt <= 0 and not block.is_null:
                raise ValueError(f"blocks[{i}] (block {block.block_id}) is free; only held blocks, whose "
                                 "KV was just written, can be cached")
        if not self.enable_caching:
            return
        index = self.cached_block_hash_to_block
        added = []
        # A policy that links blocks (on_cached) gets each block's parent as the index held it
        # right after that block was added, as the reference records it (not after the whole
        # call: a block added later in the same call is never an earlier block's parent).
        parents: list[KVCacheBlock | None] | None = [] if self._on_cached is not None else None
        try:
            for i in range(num_cached_blocks, num_full_blocks):
                block, block_hash = blocks[i], block_hashes[i]
                if block.is_null or block.block_hash is not None:
                    continue
                if block_hash not in index:
                    block.block_hash = block_hash
                    index[block_hash] = block
                    added.append(i)
                    if parents is not None:
                        parents.append(index.get(block_hashes[i - 1]) if i > 0 else None)
        except TypeError:
            for i in added:
                del index[blocks[i].block_hash]
                blocks[i].block_hash = None
            raise TypeError(f"block_hashes must hold bytes, got {type(block_hashes[i]).__name__}") from None
        if self.cache_listeners and added:
            for listener in self.cache_listeners:
                listener([blocks[i] for i in added])
        publisher = self.kv_event_publisher
        if publisher is not None and added:
            publisher.stored(block_hashes, added, token_ids, block_size, lora_name, group_idx)
        on_cached = self._on_cached
        if on_cached is not None and added:
            for i, parent in zip(added, parents or ()):  # parents is a list whenever on_cached is set
                on_cached(blocks[i], parent)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after a weight update).

        Refused (returns False, nothing changes) while any block is held by a
        request: a running request's blocks would otherwise be re-indexed from
        stale content by the next ``cache_full_blocks``. Free up first.
        """
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        policy = self.eviction_policy
        cached = list(policy.evict(len(policy))) if len(policy) else []
        policy.clear()
        for block in cached:  # in eviction order, behind the empty blocks
            block.block_hash = None
            self.free_queue.append(block)
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.cleared()
        return True

    def ref_counts(self) -> list[int]:
        """Reference count of every block (index = block id); the null block reads 0."""
        return [0 if b.is_null else b.ref_cnt for b in self.blocks]

    def free_block_ids(self) -> list[int]:
        """Free block ids in hand-out order: empty blocks, then cached ones in
        eviction order. The first is the next one handed out."""
        return [b.block_id for b in self.free_queue] + [b.block_id for b in self.eviction_policy]
