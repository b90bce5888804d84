"""``KVCacheBlock`` and the intrusive doubly linked free queue.

The links live *in* the blocks (``prev_free`` / ``next_free``), so removing a
block from the middle of the queue — what a prefix hit on a free cached block
does — is O(1) with no search and no allocation. Two sentinel blocks bound the
list so that no operation has an empty-list special case.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from servelab.blocks.hashing import BlockHash


class KVCacheBlock:
    """One physical block: its id, reference count, content hash and links.

    ``block_hash`` is set only while the block is indexed by the prefix cache.
    ``prev_free`` / ``next_free`` are non-None only while it is in a free queue.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Free blocks in eviction order: the head is handed out (and evicted) first."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def _link_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        successor = anchor.next_free
        block.prev_free, block.next_free = anchor, successor
        anchor.next_free = block
        successor.prev_free = block
        self._len += 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (last to be handed out)."""
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put a block at the head (next to be handed out)."""
        self._link_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block."""
        if self._len == 0:
            raise ValueError("the free queue is empty")
        block = self._head.next_free
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, head first."""
        if n > self._len:
            raise ValueError(f"n={n} exceeds the {self._len} blocks in the free queue")
        out = []
        node = self._head.next_free
        for _ in range(n):
            nxt = node.next_free
            node.prev_free = node.next_free = None
            out.append(node)
            node = nxt
        self._head.next_free = node
        node.prev_free = self._head
        self._len -= n
        return out
