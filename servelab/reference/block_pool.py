"""Reference ``BlockPool``: the same contract as :class:`servelab.blocks.BlockPool`,
kept in plain lists and dicts so that every rule is one readable line.

Blocks are represented by their integer ids (the fast pool hands out
``KVCacheBlock`` objects); the free queue is a Python list whose first element
is handed out first. Everything is O(n) and that is fine: this is the spec the
stateful tests hold the fast pool to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

NULL_BLOCK_ID = 0


class BlockPool:
    """Reference pool of ``num_blocks`` blocks; block 0 is the null block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.null_block = NULL_BLOCK_ID
        self.free_list: list[int] = list(range(1, num_blocks))  # index 0 = next handed out
        self.ref_cnt: dict[int, int] = {b: 0 for b in range(num_blocks)}
        self.hash_of_block: dict[int, bytes] = {}
        self.block_of_hash: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_list) / (self.num_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        if num_blocks < 0 or num_blocks > len(self.free_list):
            raise ValueError(f"num_blocks={num_blocks} must be in [0, {len(self.free_list)}]")
        taken = self.free_list[:num_blocks]
        self.free_list = self.free_list[num_blocks:]
        for block in taken:
            if block in self.hash_of_block:  # reusing a cached block evicts its content
                del self.block_of_hash[self.hash_of_block.pop(block)]
                self.num_evictions += 1
            self.ref_cnt[block] = 1
        return taken

    def free_blocks(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if block == NULL_BLOCK_ID:
                continue
            if self.ref_cnt[block] <= 0:
                raise ValueError(f"block {block} is already free")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                if block in self.hash_of_block:
                    self.free_list.append(block)  # cached content: evict last
                else:
                    self.free_list.insert(0, block)  # nothing worth keeping: reuse first

    def touch(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if block == NULL_BLOCK_ID:
                continue
            if self.ref_cnt[block] == 0:
                self.free_list.remove(block)
            self.ref_cnt[block] += 1

    def get_cached_block(self, block_hash: bytes) -> int | None:
        return self.block_of_hash.get(block_hash)

    def cache_full_blocks(self, blocks: Sequence[int], block_hashes: Sequence[bytes],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        if not 0 <= num_cached_blocks <= num_full_blocks <= min(len(blocks), len(block_hashes)):
            raise ValueError("need 0 <= num_cached_blocks <= num_full_blocks <= len(blocks), len(block_hashes)")
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block == NULL_BLOCK_ID or block in self.hash_of_block or block_hash in self.block_of_hash:
                continue  # null, already indexed, or a duplicate of indexed content
            self.hash_of_block[block] = block_hash
            self.block_of_hash[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        if len(self.free_list) != self.num_blocks - 1:
            return False
        self.hash_of_block.clear()
        self.block_of_hash.clear()
        return True

    def ref_counts(self) -> list[int]:
        return [0 if b == NULL_BLOCK_ID else self.ref_cnt[b] for b in range(self.num_blocks)]

    def free_block_ids(self) -> list[int]:
        return list(self.free_list)
