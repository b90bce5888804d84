"""KV-cache events: what a block pool tells the outside world about its prefix cache.

A router that wants to send a request where its prefix is cached needs to know
what each replica has cached, without reading the replica's memory. The pool
publishes the changes of its prefix-cache index as events, in the vocabulary
vLLM uses for its KV events (same class and field names, same meanings), so a
consumer written for one reads the other:

- :class:`BlockStored` — ``block_hashes`` (a chain: each block's parent is the
  previous one) became findable; ``parent_block_hash`` is the hash of the block
  before the first one (None when the first one starts the sequence);
  ``token_ids`` are the tokens of those blocks, ``block_size`` tokens each.
- :class:`BlockRemoved` — ``block_hashes`` are no longer findable (evicted).
- :class:`AllBlocksCleared` — the whole index was dropped (``reset_prefix_cache``).

Events are batched per scheduler step into a :class:`KVEventBatch` ``(ts,
events)``: the scheduler calls the manager's ``publish_kv_events(ts)`` at the
end of ``update_from_output``, which hands the batch to every subscriber.

**Only findable blocks.** ``BlockStored`` is emitted by
``BlockPool.cache_full_blocks``, which runs only after the step that wrote the
blocks' KV succeeded (commit after compute): a block whose step failed never
appears. A block cached under a hash that is already indexed (a duplicate) is
not indexed, and no event names it. Replaying the events in order into a set
of hashes gives exactly the pool's index (``tests/blocks/test_events.py``
checks it after every step, also under injected faults).

**Zero cost when off.** A pool without a publisher (the default) runs exactly
the code it ran before events existed, plus one ``is None`` test on the paths
that change the index (caching, eviction, reset).

**Subscribers** are plain callables ``f(batch)``; several may listen (a
router's index, an offload tier, a logger). One that raises is reported with a
``RuntimeWarning`` and counted in ``KVEventPublisher.num_subscriber_errors``;
the others still get the batch and the pool is unaffected.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from servelab.blocks.hashing import BlockHash

MEDIUM_GPU = "GPU"
"""The medium of a replica's primary KV cache (vLLM's name for it, whatever the device)."""
MEDIUM_CPU = "CPU"
"""The medium of a host-memory offload tier."""

__all__ = [
    "MEDIUM_CPU", "MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent",
    "KVEventBatch", "KVEventIndex", "KVEventPublisher", "KVEventSource", "KVEventSubscriber", "event_fields",
    "make_publisher",
]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became findable by prefix lookup.

    Attributes:
        block_hashes: the new blocks' hashes, in token order (a chain).
        parent_block_hash: hash of the block just before ``block_hashes[0]``
            in the request (None: the first block of the sequence).
        token_ids: the tokens of these blocks, ``len(block_hashes) * block_size``.
        block_size: tokens per block.
        lora_id: the adapter's integer id (None: the base model; servelab names
            adapters, see ``lora_name``).
        medium: where the blocks live (``"GPU"``: the replica's primary cache).
        lora_name: the adapter's name, part of the block hash (None: base model).
        group_idx: the KV-cache group (hybrid models), None for a single group.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer findable (evicted to make room)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix-cache index was dropped."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events of one step, in the order they happened; ``ts`` is the
    scheduler's clock when the step's output was applied."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


KVEventSubscriber = Callable[[KVEventBatch], object]


class KVEventPublisher:
    """Pending events of one pool and the subscribers their batches go to.

    The pool appends events as its index changes (:meth:`stored`,
    :meth:`removed`, :meth:`cleared`); :meth:`take_events` drains them;
    :meth:`publish` drains them into a :class:`KVEventBatch` and calls each
    subscriber with it.

    Args:
        medium: the ``medium`` field of every event.
        subscribers: callables ``f(batch)``.
    """

    __slots__ = ("medium", "pending", "subscribers", "num_subscriber_errors")

    def __init__(self, medium: str = MEDIUM_GPU, subscribers: Iterable[KVEventSubscriber] = ()) -> None:
        if not isinstance(medium, str) or not medium:
            raise ValueError(f"medium={medium!r} must be a non-empty string (e.g. 'GPU', 'CPU')")
        self.medium = medium
        self.pending: list[KVCacheEvent] = []
        self.subscribers: list[KVEventSubscriber] = []
        self.num_subscriber_errors = 0
        for s in subscribers:
            self.subscribe(s)

    def subscribe(self, subscriber: KVEventSubscriber) -> None:
        """Add ``subscriber``; it gets every batch published from now on."""
        if not callable(subscriber):
            raise TypeError(f"subscriber must be callable as f(batch), got {type(subscriber).__name__}")
        self.subscribers.append(subscriber)

    def unsubscribe(self, subscriber: KVEventSubscriber) -> None:
        """Remove ``subscriber`` (ValueError if it is not subscribed)."""
        try:
            self.subscribers.remove(subscriber)
        except ValueError:
            raise ValueError(f"{subscriber!r} is not subscribed") from None

    # ---- called by the pool ------------------------------------------------

    def stored(self, block_hashes: Sequence[BlockHash], indices: Sequence[int], token_ids: Sequence[int] | None,
               block_size: int | None, lora_name: str | None = None, group_idx: int | None = None) -> None:
        """``block_hashes[i]`` for ``i`` in ``indices`` (ascending) became
        findable; one ``BlockStored`` per run of consecutive indices."""
        pending, medium = self.pending, self.medium
        start = prev = indices[0]
        for i in [*indices[1:], None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            tokens: list[int] = []
            if token_ids is not None and block_size:
                tokens = list(token_ids[start * block_size:(prev + 1) * block_size])
            pending.append(BlockStored(list(block_hashes[start:prev + 1]),
                                       block_hashes[start - 1] if start > 0 else None,
                                       tokens, block_size or 0, None, medium, lora_name, group_idx))
            start = prev = i

    def removed(self, block_hashes: list[BlockHash]) -> None:
        self.pending.append(BlockRemoved(block_hashes, self.medium))

    def cleared(self) -> None:
        self.pending.append(AllBlocksCleared())

    # ---- called once per step ------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        """The pending events, oldest first; the queue is empty afterwards."""
        events, self.pending = self.pending, []
        return events

    def publish(self, ts: float) -> KVEventBatch | None:
        """Drain the pending events into a batch stamped ``ts`` and give it to
        every subscriber; None (and no call) when nothing happened."""
        if not self.pending:
            return None
        batch = KVEventBatch(ts, self.take_events())
        for subscriber in self.subscribers:
            try:
                subscriber(batch)
            except Exception as exc:  # a broken consumer must not break the replica
                self.num_subscriber_errors += 1
                warnings.warn(f"KV event subscriber {subscriber!r} raised {type(exc).__name__}: {exc}",
                              RuntimeWarning, stacklevel=2)
        return batch


def make_publisher(kv_events: bool, subscribers: Iterable[KVEventSubscriber] | KVEventSubscriber | None,
                   medium: str = MEDIUM_GPU) -> KVEventPublisher | None:
    """The publisher a manager attaches to its pool: None (events off, zero
    cost) unless ``kv_events`` is True or a subscriber is given."""
    if not isinstance(kv_events, bool):
        raise TypeError(f"kv_events must be a bool, got {type(kv_events).__name__}")
    if subscribers is None:
        subscribers = ()
    elif callable(subscribers):
        subscribers = (subscribers,)
    subscribers = list(subscribers)
    if not kv_events and not subscribers:
        return None
    return KVEventPublisher(medium, subscribers)


@dataclass
class KVEventIndex:
    """A replica's cached block hashes, rebuilt from its events alone (what a
    router keeps per replica). Call it with each batch (it is a subscriber).

    ``hashes`` is the set of findable hashes; :meth:`prefix_hit_blocks` is the
    longest run of a request's block hashes, from its first block, found in it.
    """

    hashes: set = field(default_factory=set)
    num_batches: int = 0

    def __call__(self, batch: KVEventBatch) -> None:
        self.apply(batch.events)
        self.num_batches += 1

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        hashes = self.hashes
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                hashes.update(event.block_hashes)
            elif kind is BlockRemoved:
                hashes.difference_update(event.block_hashes)
            elif kind is AllBlocksCleared:
                hashes.clear()
            else:
                raise TypeError(f"unknown KV event {event!r}")

    def prefix_hit_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``block_hashes`` this replica has cached."""
        hashes = self.hashes
        n = 0
        for h in block_hashes:
            if h not in hashes:
                break
            n += 1
        return n


class KVEventSource:
    """The KV-event methods of a manager that owns a ``BlockPool`` as ``self._pool``
    (``KVCacheManager`` and ``HybridKVCacheManager``)."""

    _pool: Any

    @property
    def kv_event_publisher(self) -> KVEventPublisher | None:
        """The pool's event publisher (None: events are off, or the pool cannot publish)."""
        return getattr(self._pool, "kv_event_publisher", None)

    def subscribe_kv_events(self, subscriber: KVEventSubscriber) -> None:
        """Call ``subscriber(batch)`` with every step's ``KVEventBatch`` from
        now on (turns events on if they were off)."""
        pool = self._pool
        if not hasattr(pool, "kv_event_publisher"):
            raise ValueError(f"the block pool ({type(pool).__name__}) has no kv_event_publisher attribute, so it "
                             "cannot publish KV events (servelab.blocks.BlockPool can)")
        if pool.kv_event_publisher is None:
            pool.kv_event_publisher = KVEventPublisher()
        pool.kv_event_publisher.subscribe(subscriber)

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call (or publish), oldest first; [] when off."""
        publisher = getattr(self._pool, "kv_event_publisher", None)
        return publisher.take_events() if publisher is not None else []

    def publish_kv_events(self, ts: float) -> KVEventBatch | None:
        """Batch the pending events under timestamp ``ts`` and hand the batch to
        the subscribers (the scheduler calls it once per step). None when off
        or when nothing changed."""
        publisher = getattr(self._pool, "kv_event_publisher", None)
        return publisher.publish(ts) if publisher is not None else None


def event_fields(request: Any, block_size: int) -> tuple:
    """``(token_ids, block_size, lora_name)`` of a request, for its ``BlockStored`` events."""
    tokens = getattr(request, "all_token_ids", None)
    if tokens is None:
        tokens = getattr(request, "token_ids", None)
    return tokens, block_size, getattr(request, "lora_name", None)
