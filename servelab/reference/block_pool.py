"""Reference ``BlockPool``: the same contract as :class:`servelab.blocks.BlockPool`,
kept in plain lists and dicts so that every rule is one readable line.

Blocks are represented by their integer ids (the fast pool hands out
``KVCacheBlock`` objects). Free blocks are of two kinds:

- *empty* (not indexed): a list whose first element is handed out first;
  freed empty blocks go to its front.
- *evictable* (free and still indexed): handed out only when no empty block is
  left, smallest eviction key first. The keys are the eviction policies'
  definitions, recomputed from scratch at every eviction:

  ============================ ===========================================
  ``"lru"``                    (time it became free,)
  ``"lfu"``                    (frequency + age when it became free, time):
                               frequency is 1 at indexing, +1 per prefix
                               hit (touch); age is the priority of the last
                               evicted block (LFU with dynamic aging)
  ``"fewest_descendants"``     (indexed blocks whose parent chain reaches
                               it, time): parents are recorded at indexing
                               (the block indexed under the previous
                               position's hash); evicting a block orphans
                               its children
  ============================ ===========================================

Only these registered names are modelled (no policy objects). Everything is
O(n) and that is fine: this is the spec the stateful tests hold the fast pool
and its policies to.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

NULL_BLOCK_ID = 0
REFERENCE_EVICTION_POLICIES = ("lru", "lfu", "fewest_descendants")


class BlockPool:
    """Reference pool of ``num_blocks`` blocks; block 0 is the null block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, *, eviction_policy: str = "lru") -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
        if not isinstance(enable_caching, bool):
            raise TypeError(f"enable_caching must be a bool, got {type(enable_caching).__name__}")
        if eviction_policy not in REFERENCE_EVICTION_POLICIES:
            raise ValueError(f"eviction_policy={eviction_policy!r}: the reference pool models "
                             f"{list(REFERENCE_EVICTION_POLICIES)} (by name only)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.eviction_policy = eviction_policy
        self.null_block = NULL_BLOCK_ID
        self.empty: list[int] = list(range(1, num_blocks))  # index 0 = next handed out
        self.evictable: set[int] = set()
        self.ref_cnt: dict[int, int] = {b: 0 for b in range(num_blocks)}
        self.hash_of_block: dict[int, bytes] = {}
        self.block_of_hash: dict[bytes, int] = {}
        self.num_evictions = 0
        self._forget_policy_state()

    def _forget_policy_state(self) -> None:
        self.clock = 0
        self.freed_at: dict[int, int] = {}  # evictable block -> when it became free
        self.frequency: dict[int, int] = {}  # indexed block -> 1 + prefix hits
        self.age = 0
        self.priority: dict[int, int] = {}  # evictable block -> frequency + age when it became free
        self.parent: dict[int, int] = {}  # indexed block -> its parent's block

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    # ---- eviction order ------------------------------------------------------

    def descendants(self, block: int) -> int:
        """Indexed blocks whose chain of parents passes through ``block``."""
        count = 0
        for other in self.hash_of_block:
            node = self.parent.get(other)
            while node is not None:
                if node == block:
                    count += 1
                    break
                node = self.parent.get(node)
        return count

    def eviction_key(self, block: int) -> tuple:
        if self.eviction_policy == "lfu":
            return (self.priority[block], self.freed_at[block])
        if self.eviction_policy == "fewest_descendants":
            return (self.descendants(block), self.freed_at[block])
        return (self.freed_at[block],)

    def _evict_one(self) -> int:
        """Remove the evictable block with the smallest key from the index."""
        victim = min(self.evictable, key=self.eviction_key)
        if self.eviction_policy == "lfu":
            self.age = self.priority[victim]
        self.evictable.remove(victim)
        del self.block_of_hash[self.hash_of_block.pop(victim)]
        self.frequency.pop(victim, None)
        self.parent.pop(victim, None)
        for child in [c for c, p in self.parent.items() if p == victim]:
            del self.parent[child]
        return victim

    # ---- allocation ----------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if num_blocks < 0 or num_blocks > self.num_free_blocks:
            raise ValueError(f"num_blocks={num_blocks} must be in [0, {self.num_free_blocks}]")
        taken = self.empty[:num_blocks]
        self.empty = self.empty[num_blocks:]
        while len(taken) < num_blocks:  # reusing a cached block evicts its content
            taken.append(self._evict_one())
            self.num_evictions += 1
        for block in taken:
            self.ref_cnt[block] = 1
        return taken

    def _check_blocks(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
                raise TypeError(f"blocks must hold block ids in [0, {self.num_blocks}), got {block!r}")

    def free_blocks(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        self._check_blocks(blocks)
        for block, times in Counter(b for b in blocks if b != NULL_BLOCK_ID).items():
            if self.ref_cnt[block] < times:  # validate everything before changing anything
                raise ValueError(f"block {block} is already free, or listed more often than referenced")
        for block in blocks:
            if block == NULL_BLOCK_ID:
                continue
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                if block in self.hash_of_block:  # cached content: keep it findable, evict later
                    self.clock += 1
                    self.freed_at[block] = self.clock
                    self.priority[block] = self.frequency.get(block, 1) + self.age
                    self.evictable.add(block)
                else:
                    self.empty.insert(0, block)  # nothing worth keeping: reuse first

    def touch(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        self._check_blocks(blocks)
        for block in blocks:
            if block == NULL_BLOCK_ID:
                continue
            if self.ref_cnt[block] == 0:
                if block in self.evictable:
                    self.evictable.remove(block)
                else:
                    self.empty.remove(block)
            self.ref_cnt[block] += 1
            if block in self.hash_of_block:
                self.frequency[block] = self.frequency.get(block, 1) + 1

    # ---- prefix cache ----------------------------------------------------------

    def get_cached_block(self, block_hash: bytes) -> int | None:
        return self.block_of_hash.get(block_hash)

    def cache_full_blocks(self, blocks: Sequence[int], block_hashes: Sequence[bytes],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        self._check_blocks(blocks)
        if not 0 <= num_cached_blocks <= num_full_blocks <= min(len(blocks), len(block_hashes)):
            raise ValueError("need 0 <= num_cached_blocks <= num_full_blocks <= len(blocks), len(block_hashes)")
        for i in range(num_cached_blocks, num_full_blocks):
            if blocks[i] != NULL_BLOCK_ID and self.ref_cnt[blocks[i]] == 0:
                raise ValueError(f"blocks[{i}] is free; only held blocks can be cached")
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block == NULL_BLOCK_ID or block in self.hash_of_block or block_hash in self.block_of_hash:
                continue  # null, already indexed, or a duplicate of indexed content
            self.hash_of_block[block] = block_hash
            self.block_of_hash[block_hash] = block
            self.frequency[block] = 1
            parent = self.block_of_hash.get(block_hashes[i - 1]) if i > 0 else None
            if parent is not None and not self._descends_from(parent, block):
                self.parent[block] = parent

    def _descends_from(self, node: int | None, block: int) -> bool:
        """Whether ``block`` is ``node`` or one of its ancestors: linking ``block`` under ``node``
        would then close a cycle (possible when the index maps a parent's hash to a block further
        down the same chain), so the link is not made (as in the fast pool's policy)."""
        while node is not None:
            if node == block:
                return True
            node = self.parent.get(node)
        return False

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        while self.evictable:  # formerly cached blocks queue behind the empty ones, in eviction order
            self.empty.append(self._evict_one())
        self.hash_of_block.clear()
        self.block_of_hash.clear()
        self._forget_policy_state()
        return True

    def ref_counts(self) -> list[int]:
        return [0 if b == NULL_BLOCK_ID else self.ref_cnt[b] for b in range(self.num_blocks)]

    def free_block_ids(self) -> list[int]:
        """Empty blocks, then evictable ones in the order they would be evicted."""
        return list(self.empty) + self._eviction_order()

    def _eviction_order(self) -> list[int]:
        if self.eviction_policy != "fewest_descendants":
            return sorted(self.evictable, key=self.eviction_key)
        # Evicting changes descendant counts: simulate on a copy.
        saved = (set(self.evictable), dict(self.hash_of_block), dict(self.block_of_hash), dict(self.parent),
                 dict(self.frequency), self.age)
        order = []
        while self.evictable:
            order.append(self._evict_one())
        (self.evictable, self.hash_of_block, self.block_of_hash, self.parent, self.frequency, self.age) = saved
        return order
