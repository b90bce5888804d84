"""``BlockPool``: the physical KV blocks, their reference counts, the free
queue and the prefix-cache index.

Life of a block::

    free (in queue, maybe hashed) --get_new_blocks--> owned (ref_cnt >= 1)
    owned --cache_full_blocks--> owned and hashed (findable by prefix hits)
    owned --free_blocks, ref_cnt reaches 0--> free again
        unhashed: to the queue's HEAD  (reused first: its content is worthless)
        hashed:   to the queue's TAIL  (evicted last: least recently used first)
    free and hashed --get_cached_block + touch--> owned again (a prefix hit)
    free and hashed --popped by get_new_blocks--> evicted: hash dropped

Every operation is O(1) per block: the free queue is an intrusive doubly
linked list, so a cached block revived by a prefix hit leaves the middle of the
queue without a scan.

Block 0 is the *null block*: never handed out, never freed, its reference
count untouched. Block tables use it as a placeholder (padding rows, sliding-
window positions whose blocks were released).

Decision (differs from vLLM): when a second block is cached under a hash that
already maps to a block, the second one is *not* indexed. It stays unhashed and
returns to the queue's head when freed, so duplicates never take cache space
from distinct content, and ``get_cached_block`` has exactly one answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from servelab.blocks.free_queue import FreeBlockQueue, KVCacheBlock
from servelab.blocks.hashing import BlockHash
from servelab.blocks.specs import require_nonneg_int

NULL_BLOCK_ID = 0


class BlockPool:
    """All ``num_blocks`` KV blocks of one cache (block 0 is the null block).

    Args:
        num_blocks: total blocks including the null block; at least 2.
        enable_caching: index full blocks by hash for prefix caching. When
            False, ``cache_full_blocks`` is a no-op and no block is ever hashed.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
        if not isinstance(enable_caching, bool):
            raise TypeError(f"enable_caching must be a bool, got {type(enable_caching).__name__}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.is_null = True
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    # ---- allocation -----------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out now (cached-but-free included)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by requests."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue, evicting
        any cached content they hold; each comes back with ``ref_cnt == 1``."""
        require_nonneg_int(num_blocks, "num_blocks")
        if num_blocks > len(self.free_queue):
            raise ValueError(
                f"num_blocks={num_blocks} exceeds the {len(self.free_queue)} free blocks; "
                "ask for at most num_free_blocks"
            )
        blocks = self.free_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def _own(self, blocks: Iterable[KVCacheBlock], name: str) -> list[KVCacheBlock]:
        """``blocks`` as a list, checked to be this pool's blocks before any
        state changes (so a bad argument never leaves the pool half-updated)."""
        if type(blocks) is not list:
            blocks = list(blocks)
        mine = self.blocks
        try:
            for b in blocks:
                if mine[b.block_id] is not b:
                    raise ValueError(f"{name} contains {b!r}, which belongs to another pool")
        except (AttributeError, IndexError, TypeError):
            kinds = sorted({type(b).__name__ for b in blocks})
            raise TypeError(f"{name} must contain this pool's KVCacheBlock objects, got {kinds}") from None
        return blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order; blocks that
        reach zero go back to the free queue (unhashed to the head, hashed to
        the tail). Callers free a request's blocks tail-first, so that among
        blocks freed together the end of a hash chain is evicted before its
        more shareable prefix."""
        for block in self._own(blocks, "blocks"):
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} is already free (ref_cnt={block.ref_cnt}); "
                                 "each reference may be freed once")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit), pulling free
        ones out of the queue so they cannot be evicted while in use."""
        for block in self._own(blocks, "blocks"):
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

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
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]`` under
        ``block_hashes`` at the same positions.

        ``blocks`` and ``block_hashes`` are one request's block list and hash
        list (position i of both covers tokens ``[i*bs, (i+1)*bs)``). Null
        blocks are skipped; a hash already indexed keeps its first block.
        """
        blocks = self._own(blocks, "blocks")
        require_nonneg_int(num_cached_blocks, "num_cached_blocks")
        require_nonneg_int(num_full_blocks, "num_full_blocks")
        if num_cached_blocks > num_full_blocks:
            raise ValueError(
                f"num_cached_blocks={num_cached_blocks} must be <= num_full_blocks={num_full_blocks}"
            )
        if num_full_blocks > len(blocks) or num_full_blocks > len(block_hashes):
            raise ValueError(
                f"num_full_blocks={num_full_blocks} exceeds len(blocks)={len(blocks)} "
                f"or len(block_hashes)={len(block_hashes)}"
            )
        if not self.enable_caching:
            return
        index = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.is_null or block.block_hash is not None:
                continue
            if block_hash not in index:
                block.block_hash = block_hash
                index[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after a weight update).

        Refused (returns False, nothing changes) while any block is held by a
        request: a running request's blocks would otherwise be re-indexed from
        stale content by the next ``cache_full_blocks``. Free up first.
        """
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def ref_counts(self) -> list[int]:
        """Reference count of every block (index = block id); the null block reads 0."""
        return [0 if b.is_null else b.ref_cnt for b in self.blocks]

    def free_block_ids(self) -> list[int]:
        """Free block ids in queue order: the first is the next one handed out."""
        return [b.block_id for b in self.free_queue]
