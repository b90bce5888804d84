"""``TierStore``: KV blocks outside the pool, keyed by block hash, with a capacity and an eviction policy.

A tier holds at most ``capacity`` blocks. Its slots are
:class:`~servelab.blocks.free_queue.KVCacheBlock` objects so that the pool's
own eviction policies (:mod:`servelab.blocks.eviction`: ``"lru"``, ``"lfu"``,
``"fewest_descendants"``) choose what a full tier drops: every stored block
is "free and indexed" to the policy, a read is a hit (``remove`` + ``push``:
it becomes most recently used). Two media:

- memory (``directory=None``): the payload tensors themselves (host memory);
- a directory: one ``torch.save`` file per block, named by the hash (hex),
  deleted when evicted.

A payload is a list of tensors (one block of each layer's ``K`` and ``V`` of
one KV-cache group, ``[block_size, num_kv_heads, head_size]`` each). Thread
safety: every method takes the tier's lock (a loader thread reads while the
scheduler's thread stores).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from servelab._internal.validation import check_int
from servelab.blocks.eviction import get_eviction_policy
from servelab.blocks.free_queue import KVCacheBlock

__all__ = ["TierStats", "TierStore"]


@dataclass
class TierStats:
    """Counters of one tier (blocks)."""

    stored: int = 0
    evicted: int = 0
    hits: int = 0
    """Blocks read back into the pool from this tier."""
    failed_reads: int = 0


class TierStore:
    """See the module docstring.

    Args:
        name: ``"host"``, ``"disk"``... (reports).
        capacity: blocks it holds at most (>= 1).
        eviction_policy: a registered eviction policy name or a fresh policy object.
        directory: None (memory) or a folder for one file per block (created).
    """

    def __init__(self, name: str, capacity: int, eviction_policy: Any = "lru",
                 directory: str | os.PathLike | None = None) -> None:
        check_int("capacity", capacity, min_value=1)
        self.name = name
        self.capacity = capacity
        self.policy = get_eviction_policy(eviction_policy)
        self.directory = Path(directory) if directory is not None else None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._free = [KVCacheBlock(i) for i in range(capacity - 1, -1, -1)]
        self._index: dict[bytes, KVCacheBlock] = {}
        self._payload: dict[int, list[torch.Tensor]] = {}  # slot id -> tensors (memory tier)
        self._lock = threading.Lock()
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def _path(self, key: bytes) -> Path:
        assert self.directory is not None
        return self.directory / f"{key.hex()}.pt"

    def put(self, key: bytes, payload: list[torch.Tensor]) -> list[tuple[bytes, list[torch.Tensor]]]:
        """Store ``payload`` under ``key`` (a no-op if present). Returns what was
        evicted to make room, as ``(key, payload)`` (for a lower tier)."""
        evicted: list[tuple[bytes, list[torch.Tensor]]] = []
        with self._lock:
            if key in self._index:
                return evicted
            if not self._free:
                (victim,) = self.policy.evict(1)
                old = victim.block_hash
                assert old is not None  # the policy holds indexed slots only
                del self._index[old]
                evicted.append((old, self._drop(victim)))
                victim.block_hash = None
                self._free.append(victim)
                self.stats.evicted += 1
            slot = self._free.pop()
            if self.directory is not None:
                torch.save([t.contiguous() for t in payload], self._path(key))
            else:
                self._payload[slot.block_id] = payload
            slot.block_hash = key
            self._index[key] = slot
            on_cached = getattr(self.policy, "on_cached", None)
            if on_cached is not None:
                on_cached(slot, None)
            self.policy.push(slot)
            self.stats.stored += 1
        return evicted

    def _drop(self, slot: KVCacheBlock) -> list[torch.Tensor]:
        """Forget a slot's payload; returns it (read from disk for a directory tier)."""
        if self.directory is None:
            return self._payload.pop(slot.block_id)
        assert slot.block_hash is not None
        path = self._path(slot.block_hash)
        try:
            payload = torch.load(path, weights_only=True)
        except (OSError, RuntimeError):
            payload = []
        path.unlink(missing_ok=True)
        return payload

    def get(self, key: bytes) -> list[torch.Tensor] | None:
        """The payload under ``key`` (a hit: most recently used now), or None. A disk
        read that fails (the file went away) counts in ``failed_reads`` and forgets the key."""
        with self._lock:
            slot = self._index.get(key)
            if slot is None:
                return None
            self.policy.remove(slot)
            on_hit = getattr(self.policy, "on_hit", None)
            if on_hit is not None:
                on_hit(slot)
            self.policy.push(slot)
            if self.directory is None:
                self.stats.hits += 1
                return self._payload[slot.block_id]
            path = self._path(key)
        try:
            payload = torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError):
            self.discard(key)
            with self._lock:
                self.stats.failed_reads += 1
            return None
        with self._lock:
            self.stats.hits += 1
        return payload

    def discard(self, key: bytes) -> None:
        """Forget ``key`` (its content is unusable)."""
        with self._lock:
            slot = self._index.pop(key, None)
            if slot is None:
                return
            self.policy.remove(slot)
            if self.directory is None:
                self._payload.pop(slot.block_id, None)
            else:
                self._path(key).unlink(missing_ok=True)
            slot.block_hash = None
            self._free.append(slot)
