"""The block layer's seams as ``typing.Protocol``s: the contract, in one place.

Three pieces can be swapped, each checked with ``isinstance`` (the protocols
are runtime checkable: the check is that the members exist; the docstrings
say what they must do):

- :class:`KVCacheManagerProtocol` — what the scheduler and the pipeline call.
  Implemented by :class:`servelab.blocks.KVCacheManager` and by the plain
  reference :class:`servelab.reference.KVCacheManager`.
- :class:`BlockPoolProtocol` — the physical blocks behind one manager.
  Implemented by :class:`servelab.blocks.BlockPool` (blocks are
  ``KVCacheBlock`` objects) and :class:`servelab.reference.BlockPool`
  (blocks are ints). A manager works with its own family's pool: the fast
  :class:`~servelab.blocks.KVCacheManager` takes any object conforming to this
  Protocol whose blocks are ``KVCacheBlock`` objects (``block_pool=``, e.g. a
  wrapper delegating to a ``BlockPool``), the reference manager a reference pool.
- :class:`EvictionPolicy` — which free cached block the pool evicts first.

The rule every implementation keeps (**commit after compute**): a block
becomes findable by prefix lookup only after the step that writes its KV has
succeeded. ``allocate_slots`` never indexes anything; the scheduler calls
``cache_blocks(request, request.num_computed_tokens)`` in
``update_from_output``, after rejected draft tokens are subtracted. A step
that fails, or a request preempted in the step that scheduled it, therefore
never leaves uncomputed blocks findable.

And every public method either fully applies or leaves no trace: arguments
are validated before any state changes.

**Per-group shapes** (as vLLM's KV cache coordinator): a manager serves one or
more KV-cache groups (layers sharing one block table; a full-attention model
has one, a hybrid model one per kind, see
:class:`~servelab.blocks.HybridKVCacheManager`). Block ids and newly allocated
blocks always come as a tuple with one list per group, in group order: a
single-group manager returns 1-tuples (``([1, 2, 3],)``), never a bare list.
So every consumer (scheduler, model runner, KV connectors) reads group ``g``
as ``ids[g]`` whatever the manager.

Call order, per request (scheduler)::

    admission:  blocks, n_hit = get_computed_blocks(req)          # no side effect
                allocate_slots(req, n, n_hit, blocks, lookahead)  # None: nothing changed
    each step:  allocate_slots(req, n, 0, None, lookahead)        # None: preempt someone, retry
    after step: cache_blocks(req, req.num_computed_tokens)        # KV written: index full blocks
    end:        free(req)                                         # preemption, finish, abort
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from servelab.blocks.request import KVCacheRequest

if TYPE_CHECKING:
    from servelab.blocks.free_queue import KVCacheBlock
    from servelab.blocks.hashing import BlockHash
    from servelab.blocks.stats import PrefixCacheStats
    from servelab.blocks.specs import KVCacheSpec

__all__ = ["BlockPoolProtocol", "EvictionPolicy", "KVCacheManagerProtocol", "KVCacheRequest"]


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses which free cached blocks a :class:`~servelab.blocks.BlockPool` evicts.

    The pool keeps free *empty* blocks (no indexed content) itself and hands
    them out first; the policy holds exactly the free blocks that are still
    indexed (``block.block_hash is not None``, ``block.ref_cnt == 0``) and
    is asked only when the pool runs out of empty ones. One policy object
    serves one pool, which calls (never concurrently):

    - ``push(block)`` when a cached block's last reference is freed (it
      becomes evictable). ``free_blocks`` pushes in the order its argument
      lists blocks, so a manager freeing a request tail-first pushes the
      end of the prefix chain first.
    - ``remove(block)`` when an evictable block leaves without being evicted:
      a prefix hit revives it (``touch``), or a failed ``free_blocks`` is
      undone. Must undo ``push`` exactly.
    - ``evict(n)`` with ``0 < n <= len(self)``: remove and return ``n``
      blocks, first evicted first. The pool then drops their hashes (they
      are no longer findable), counts the evictions and hands them out.
      A policy that raises here leaves the pool unchanged.
    - ``clear()`` from ``reset_prefix_cache``, after the pool took every
      block back with ``evict(len(self))``: forget all state.
    - ``len(policy)``: how many evictable blocks it holds (the pool's
      ``num_free_blocks`` includes them); ``iter(policy)``: them in
      eviction order (for ``free_block_ids``, tests and plots; not on the
      hot path).

    Optional hooks, called only if the policy defines them:

    - ``on_cached(block, parent)``: ``block`` (held) was just indexed;
      ``parent`` is the indexed block holding the previous position's hash
      of the same request, or None (first block, or parent not indexed).
      For policies that track frequency or the prefix tree.
    - ``on_hit(block)``: a prefix hit took a reference on the cached
      ``block`` (held or free; for free ones ``remove`` comes first).

    Attributes:
        name: a short label for reports.
    """

    name: str

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[KVCacheBlock]: ...

    def push(self, block: KVCacheBlock) -> None: ...

    def remove(self, block: KVCacheBlock) -> None: ...

    def evict(self, n: int) -> list[KVCacheBlock]: ...

    def clear(self) -> None: ...


@runtime_checkable
class BlockPoolProtocol(Protocol):
    """``num_blocks`` KV blocks: reference counts, free blocks, the prefix-cache index.

    Block 0 is the null block (placeholder in block tables: never handed out,
    never freed, its count untouched). "Block" below means the pool's block
    handle: a ``KVCacheBlock`` in the fast pool, an ``int`` id in the
    reference. Every method validates its whole argument before changing
    anything: a ValueError / TypeError leaves the pool as it was.

    Attributes:
        num_blocks: total blocks, null block included (>= 2).
        enable_caching: when False nothing is ever indexed.
        null_block: block 0's handle.
        num_evictions: cached blocks reused for new content so far.
        eviction_policy: the policy's name (fast pool: the policy object).
    """

    num_blocks: int
    enable_caching: bool
    null_block: Any
    num_evictions: int

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``get_new_blocks`` can hand out now (evictable cached ones included)."""
        ...

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by requests, in [0, 1]."""
        ...

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        """``num_blocks`` free blocks, each with one reference: empty ones
        first (most recently freed first), then cached ones in the policy's
        eviction order (their hashes are dropped). ValueError when
        ``num_blocks > num_free_blocks``."""
        ...

    def free_blocks(self, blocks: Sequence[Any]) -> None:
        """Drop one reference per listed block (a block listed k times drops
        k). A block reaching zero becomes free: empty ones are handed out
        next, cached ones go to the eviction policy. Raises (changing
        nothing) if any block would go below zero. Null blocks are skipped."""
        ...

    def touch(self, blocks: Sequence[Any]) -> None:
        """Take one reference per block (a prefix hit); free ones stop being
        evictable. Null blocks are skipped."""
        ...

    def get_cached_block(self, block_hash: BlockHash) -> Any | None:
        """The block indexed under ``block_hash``, or None."""
        ...

    def cache_full_blocks(self, blocks: Sequence[Any], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Index held ``blocks[num_cached_blocks:num_full_blocks]`` under the
        hashes at the same positions (one request's block and hash lists).
        Null blocks, already indexed blocks and hashes indexed by another
        block (duplicate content) are skipped. Only for blocks whose KV is
        written (see the module doc)."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Forget every index entry; refused (False, nothing changes) while
        any block is held."""
        ...

    def ref_counts(self) -> list[int]:
        """Reference count per block id (the null block reads 0)."""
        ...

    def free_block_ids(self) -> list[int]:
        """Free block ids in hand-out order (the first is handed out next)."""
        ...


@runtime_checkable
class KVCacheManagerProtocol(Protocol):
    """The KV memory of one cache spec, as the scheduler and the pipeline see it.

    Requests are anything with ``request_id``, ``num_tokens``,
    ``num_computed_tokens`` and ``block_hashes`` (:class:`KVCacheRequest`).

    Used by the scheduler: ``block_size``, ``enable_caching``,
    ``max_model_len``, ``num_blocks``, ``usage``, ``get_computed_blocks``,
    ``allocate_slots``, ``cache_blocks``, ``free``, ``get_block_ids``.
    Used by the pipeline: ``spec``, ``block_size``, ``num_blocks``, ``usage``,
    ``num_free_blocks``. Reports: ``prefix_cache_stats``, ``block_pool``.

    Attributes:
        spec: the ``KVCacheSpec`` (block size, heads, dtype) the KV tensors follow.
        block_size: tokens per block.
        enable_caching: prefix caching on.
        max_model_len: longest sequence a request may reach (None: unbounded).
        block_pool: the pool; the manager is its only owner. Assigning
            another pool works only while no request holds blocks, and
            raises otherwise.
        prefix_cache_stats: ``requests`` / ``queried_tokens`` /
            ``hit_tokens`` / ``hit_rate``, counted once per admission.
    """

    spec: KVCacheSpec
    block_size: int
    enable_caching: bool
    max_model_len: int | None
    prefix_cache_stats: PrefixCacheStats

    @property
    def block_pool(self) -> Any:
        """The pool (read here; a manager may also let it be assigned, see above)."""
        ...

    @property
    def num_blocks(self) -> int:
        """Pool size, null block included (the KV tensors have this many blocks)."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now."""
        ...

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        ...

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[tuple[Sequence[Any], ...], int]:
        """Longest cached prefix of a request being admitted: its blocks per
        KV-cache group (a tuple with one list per group, a 1-tuple for a
        single-group manager: the shape ``allocate_slots`` returns; not yet
        referenced) and its length in tokens, a multiple of ``block_size``
        and at most ``num_tokens - 1`` (the last token is always computed:
        its logits are the point). No side effect; nothing hit (empty lists,
        0) with caching off. Pass the blocks unchanged to ``allocate_slots``."""
        ...

    def allocate_slots(self, request: KVCacheRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: tuple[Sequence[Any], ...] | None = None,
                       num_lookahead_tokens: int = 0) -> tuple[list[Any], ...] | None:
        """Hold slots for ``request.num_computed_tokens + num_new_computed_tokens
        + num_new_tokens + num_lookahead_tokens`` tokens (clipped at
        ``max_model_len``). ``new_computed_blocks`` (the hit exactly as
        ``get_computed_blocks`` returned it, admission only) gain a reference.

        Returns None when the blocks don't fit (watermark included for
        admissions) — then nothing changed. Otherwise the newly allocated
        blocks per group: a tuple with one list per KV-cache group (a 1-tuple
        for a single-group manager; lists may be empty: nothing new), each
        block a pool handle (a ``KVCacheBlock`` with ``.block_id`` in the fast
        pool, a plain ``int`` id in the reference). That is vLLM's
        ``KVCacheBlocks.blocks`` without the wrapper object: the scheduler
        needs only "None = no room", the new blocks (for the step's
        ``new_block_ids``) and their count (``len(result[0])`` tracks a
        single-group request's slots), and a bare tuple costs nothing on the
        decode path. Never indexes a block; counts prefix-cache stats when
        it admits a request."""
        ...

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """Make the request's full blocks covering its first
        ``num_computed_tokens`` tokens findable by prefix lookup. Call only
        once their KV is written. Incremental and idempotent; no-op with
        caching off or for a request holding no blocks."""
        ...

    def free(self, request: KVCacheRequest | str) -> None:
        """Release every block of a request (tail first). Idempotent."""
        ...

    def get_block_ids(self, request: KVCacheRequest | str) -> tuple[list[int], ...]:
        """The request's block-table rows, one per KV-cache group (a 1-tuple
        for a single-group manager): ``result[g]`` is group ``g``'s block ids
        in token order (0 = null block). Empty lists for a request holding
        nothing. Fresh lists: the caller may keep or change them."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while requests hold blocks."""
        ...
