"""Eviction policies: which free *cached* block the pool gives up first.

Division of labour (see :class:`~servelab.blocks.interfaces.EvictionPolicy`
for the contract). The :class:`~servelab.blocks.BlockPool` keeps free blocks
that hold no cached content in its own O(1) queue and always hands those out
first: their content is worthless, so no policy could prefer anything else.
A policy holds only the free blocks whose content is still findable by prefix
lookup, and answers one question: when the pool needs more blocks than it has
empty ones, which cached blocks are evicted, in what order.

Registered policies (``available_eviction_policies()``):

- ``"lru"`` (default): least recently *freed* first. An intrusive doubly
  linked list (the pool's own free-queue type), O(1) per operation. Because a
  manager frees a request's blocks tail-first, the end of a prefix chain is
  evicted before its more shareable start.
- ``"lfu"``: least frequently used, with dynamic aging (LFU-DA). A block's
  frequency is 1 when it is indexed, +1 per prefix hit on it. When it becomes
  free its priority is ``frequency + age``; the block with the lowest priority
  is evicted (ties: least recently freed) and ``age`` becomes its priority, so
  old popular blocks eventually lose to new ones. O(log n) (a heap with lazy
  deletion).
- ``"fewest_descendants"``: blocks with the fewest cached descendants in the
  prefix tree first (leaves first, like a radix-tree cache), ties least
  recently freed first. Keeps the shared start of many prompts longest.
  O(log n) plus a walk up the block's ancestors when the tree changes.

A new policy plugs in with ``register_eviction_policy("name", MyPolicy)``
(a class or zero-argument factory: every pool gets its own instance) or by
passing an instance: ``BlockPool(n, eviction_policy=MyPolicy())``. One policy
object serves one pool.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Iterator
from typing import Any

from servelab._internal.conformance import missing_members
from servelab._internal.registry import Registry
from servelab.blocks.free_queue import FreeBlockQueue, KVCacheBlock
from servelab.blocks.interfaces import EvictionPolicy

__all__ = [
    "FewestDescendantsEvictionPolicy", "LFUEvictionPolicy", "LRUEvictionPolicy", "available_eviction_policies",
    "get_eviction_policy", "register_eviction_policy",
]


class LRUEvictionPolicy(FreeBlockQueue):
    """Least recently freed first: today's (and vLLM's) order.

    It *is* a :class:`FreeBlockQueue`: ``push`` appends at the tail, ``evict``
    pops from the head, ``remove`` unlinks in O(1) — the same calls, at the
    same cost, as before eviction became a policy.
    """

    name = "lru"

    def __init__(self) -> None:
        super().__init__(())

    push = FreeBlockQueue.append
    evict = FreeBlockQueue.popleft_n

    def clear(self) -> None:
        if self._len:
            raise ValueError(f"clear() with {self._len} blocks still queued; evict them first")


class _HeapPolicy:
    """Shared machinery: free cached blocks in a heap of ``(key..., tick, id)``
    with lazy deletion (a removed block's entry stays until it surfaces)."""

    name = ""

    def __init__(self) -> None:
        self._heap: list[tuple] = []
        self._entry: dict[int, tuple] = {}  # block id -> its live heap entry
        self._blocks: dict[int, KVCacheBlock] = {}
        self._tick = 0

    def __len__(self) -> int:
        return len(self._entry)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        # Evicting can change the keys of others (aging, descendant counts):
        # the true order comes from evicting everything from a copy.
        twin = copy.deepcopy(self, {id(b): b for b in self._blocks.values()})
        return iter(twin.evict(len(twin)))

    def _key(self, block_id: int) -> tuple:
        raise NotImplementedError

    def _set_entry(self, block_id: int, entry: tuple) -> None:
        self._entry[block_id] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._entry) + 64:  # too many stale entries: compact
            self._heap = sorted(self._entry.values())

    def push(self, block: KVCacheBlock) -> None:
        block_id = block.block_id
        if block_id in self._entry:
            raise ValueError(f"block {block_id} is already evictable")
        self._tick += 1
        self._blocks[block_id] = block
        self._set_entry(block_id, (*self._key(block_id), self._tick, block_id))

    def remove(self, block: KVCacheBlock) -> None:
        block_id = block.block_id
        if self._entry.pop(block_id, None) is None:
            raise ValueError(f"block {block_id} is not evictable (not free, or not cached)")
        del self._blocks[block_id]

    def _pop(self) -> tuple:
        heap, entry = self._heap, self._entry
        while True:
            item = heapq.heappop(heap)
            if entry.get(item[-1]) == item:
                del entry[item[-1]]
                return item

    def evict(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._entry):
            raise ValueError(f"n={n} exceeds the {len(self._entry)} evictable blocks")
        out = []
        for _ in range(n):
            item = self._pop()
            out.append(self._blocks.pop(item[-1]))
            self._forget(item)
        return out

    def _forget(self, item: tuple) -> None:
        """The block of heap entry ``item`` was evicted: drop its bookkeeping."""

    def clear(self) -> None:
        self.__init__()


class LFUEvictionPolicy(_HeapPolicy):
    """Least frequently used with dynamic aging (LFU-DA); see the module doc."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._freq: dict[int, int] = {}  # indexed block id -> 1 + prefix hits since indexing
        self.age = 0

    def _key(self, block_id: int) -> tuple:
        return (self._freq.get(block_id, 1) + self.age,)

    def on_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        self._freq[block.block_id] = 1

    def on_hit(self, block: KVCacheBlock) -> None:
        self._freq[block.block_id] = self._freq.get(block.block_id, 1) + 1

    def _forget(self, item: tuple) -> None:
        self.age = item[0]
        self._freq.pop(item[-1], None)


class FewestDescendantsEvictionPolicy(_HeapPolicy):
    """Fewest cached descendants first, ties least recently freed; see the module doc.

    The prefix tree is over indexed blocks: a block's parent is the indexed
    block holding the previous position's hash when it was indexed. Evicting
    a block with descendants (possible only when they are held, e.g. a sliding
    window released the parent) orphans them: they stay cached, as roots.
    """

    name = "fewest_descendants"

    def __init__(self) -> None:
        super().__init__()
        self._parent: dict[int, int] = {}
        self._children: dict[int, set[int]] = {}
        self._desc: dict[int, int] = {}

    def _key(self, block_id: int) -> tuple:
        return (self._desc.get(block_id, 0),)

    def _add_to_ancestors(self, block_id: int, delta: int) -> None:
        ancestor = self._parent.get(block_id)
        while ancestor is not None:
            self._desc[ancestor] = self._desc.get(ancestor, 0) + delta
            old = self._entry.get(ancestor)
            if old is not None:  # free: its key changed (same tick)
                self._set_entry(ancestor, (self._desc[ancestor], old[1], ancestor))
            ancestor = self._parent.get(ancestor)

    def on_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        block_id = block.block_id
        if block_id in self._parent:  # a block re-indexed under a new hash: drop its old link first
            self._add_to_ancestors(block_id, -1 - self._desc.get(block_id, 0))
            self._children[self._parent.pop(block_id)].discard(block_id)
        self._desc[block_id] = 0
        ancestor = None if parent is None else parent.block_id
        while ancestor is not None:  # never link a block under its own descendant (a cycle)
            if ancestor == block_id:
                parent = None
                break
            ancestor = self._parent.get(ancestor)
        if parent is not None:
            self._parent[block_id] = parent.block_id
            self._children.setdefault(parent.block_id, set()).add(block_id)
            self._add_to_ancestors(block_id, 1)

    def _forget(self, item: tuple) -> None:
        block_id = item[-1]
        self._add_to_ancestors(block_id, -1 - self._desc.get(block_id, 0))
        parent = self._parent.pop(block_id, None)
        if parent is not None:
            self._children[parent].discard(block_id)
        for child in self._children.pop(block_id, ()):
            del self._parent[child]
        self._desc.pop(block_id, None)


def _check_policy(obj: Any) -> None:
    if isinstance(obj, type):
        raise TypeError(f"eviction_policy must be an instance or a registered name, got the class "
                        f"{obj.__name__}; pass {obj.__name__}() or register it")
    if not isinstance(obj, EvictionPolicy):
        missing = missing_members(obj, EvictionPolicy)
        raise TypeError(f"eviction_policy {type(obj).__name__} does not implement EvictionPolicy "
                        f"(missing {missing}); valid: a registered name "
                        f"{available_eviction_policies()} or an EvictionPolicy object")


_REGISTRY: Registry[EvictionPolicy] = Registry("eviction policy", factory=True, check=_check_policy)
_REGISTRY.register("lru", LRUEvictionPolicy)
_REGISTRY.register("lfu", LFUEvictionPolicy)
_REGISTRY.register("fewest_descendants", FewestDescendantsEvictionPolicy)


def register_eviction_policy(name: str, factory: Any, *, override: bool = False) -> None:
    """Make ``BlockPool(..., eviction_policy=name)`` build ``factory()``: a
    class or zero-argument callable returning an :class:`EvictionPolicy`
    (each pool needs its own instance), or a lazy ``"module:attr"`` string.
    A taken name raises ValueError unless ``override=True``."""
    _REGISTRY.register(name, factory, override=override)


def get_eviction_policy(name_or_obj: str | EvictionPolicy) -> EvictionPolicy:
    """A new instance of the registered policy ``name``, or ``name_or_obj``
    itself if it is an :class:`EvictionPolicy` object. Unknown names raise
    ValueError listing the known ones; other objects raise TypeError."""
    policy = _REGISTRY.get(name_or_obj)
    if isinstance(name_or_obj, str):
        _check_policy(policy)
    return policy


def available_eviction_policies() -> list[str]:
    """Registered eviction policy names, sorted."""
    return _REGISTRY.available()
