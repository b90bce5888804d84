"""``HybridKVCacheManager``: one block pool shared by groups of layers of different kinds.

A hybrid model (Gemma 2: alternating sliding-window and full-attention layers;
Jamba-like: attention and Mamba layers) has layers whose caches grow
differently. Following vLLM v1, layers are put into **KV-cache groups**
(:class:`KVCacheGroup`): all layers of a group have the same spec, and share one
block table per request. Every group draws its blocks from **one** pool.

**The page-size rule (shared pool).** A block id of the pool addresses one page
in each of ``group_size`` KV tensors; tensor ``j`` is shared by the ``j``-th
layer of *every* group (a block id is owned by one group at a time, so they
never collide). Hence every group must have the same number of layers
(:func:`make_kv_cache_groups` splits larger kinds into several groups) and
every attention group the same ``page_size_bytes`` per layer. Mamba pages may
be smaller (they are padded up to the common page size). When attention
pages differ, :func:`unify_page_sizes` multiplies the block size of the
smaller ones by the integer ratio (vLLM's rule); if a page does not divide the
largest one, it refuses with the reason. Memory for ``num_blocks`` blocks is
thus ``num_blocks * page_size_bytes * group_size`` whatever the mix of kinds,
and a sliding-window group holding only its window's blocks really frees
memory for the others.

**Block sizes.** Group block sizes must all be multiples of the smallest one,
``hash_block_size``, which is the manager's ``block_size`` (requests hash
their full blocks of that many tokens). A group with a ``k`` times larger
block identifies its block ``i`` by the request's hash number
``(i + 1) * k - 1`` (hashes are chained, so that one hash names the whole
prefix). Prefix hits are multiples of the lcm of the group block sizes.

**Prefix hits across groups** (vLLM v1): the hit is the longest prefix *every*
group can serve. Each group answers "the longest prefix up to L I can serve":
full attention needs every block of it, a sliding window only the blocks the
next token sees (the last ``ceil((window - 1) / block_size)``), a Mamba state
only the block holding the state at its end. Starting from the longest
candidate, the groups are asked in turn (full attention first), each answer
capping the next question, until no group lowers it: a fixed point, which is
the longest common prefix because every answer is the longest the group
serves below its cap. Block hashes are tagged with the group id, so the same
tokens cached by two groups are two index entries.

**Mamba with prefix caching** (vLLM's "all" cache mode): the state group then
holds one block per block of tokens, the kernel must write the state at each
block boundary into that block, and blocks older than the previous boundary
are released (a sliding window of ``block_size + 1`` tokens). With caching off
a Mamba group holds its single state block.

**Admission** (vLLM's cap, :func:`~servelab.blocks.specs.request_blocks_cap`):
a sliding group holds at most the window plus one chunk, so a request alone
in the pool runs in smaller chunks when one would not fit
(:meth:`HybridKVCacheManager.max_chunk_alone`).

**Per-group block ids.** ``get_computed_blocks`` returns a tuple of per-group
block lists, ``allocate_slots`` returns a tuple of per-group new blocks, and
``get_block_ids(request)`` returns a tuple of per-group block-id lists (group
``g``'s table row is ``get_block_ids(request)[g]``). Everything else — commit
after compute (``cache_blocks``), atomicity, stats once per admission, the
watermark — is :class:`~servelab.blocks.KVCacheManager`'s contract, which is
kept unchanged (and exactly as fast) for single-group models.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from servelab._internal.conformance import check_conforms
from servelab._internal.validation import check_bool, check_int, check_number
from servelab.blocks.block_pool import BlockPool
from servelab.blocks.events import KVEventSource, KVEventSubscriber, event_fields, make_publisher
from servelab.blocks.free_queue import KVCacheBlock
from servelab.blocks.hashing import BlockHash
from servelab.blocks.interfaces import BlockPoolProtocol, EvictionPolicy
from servelab.blocks.kv_cache_manager import PrefixCacheStats, _request_id
from servelab.blocks.request import KVCacheRequest
from servelab.blocks.single_type import (
    FullAttentionManager,
    MambaStateManager,
    group_manager,
)
from servelab.blocks.specs import AttentionSpec, KVCacheSpec, MambaSpec, max_chunk_alone

__all__ = ["GroupBlockHashes", "HybridKVCacheManager", "KVCacheGroup", "MambaStateManager",
           "make_kv_cache_groups", "unify_page_sizes"]


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one spec and one block table per request.

    Attributes:
        spec: the layers' cache spec.
        layer_indices: model layer indices in this group (may be empty in tests).
    """

    spec: KVCacheSpec
    layer_indices: tuple[int, ...] = ()


def _page_bytes(spec: KVCacheSpec) -> int:
    return spec.page_size_bytes


def unify_page_sizes(specs: Sequence[KVCacheSpec]) -> list[KVCacheSpec]:
    """Specs with equal attention page sizes: an attention spec whose page is
    ``r`` times smaller than the largest gets ``r`` times larger blocks. Mamba
    pages are left as they are when they fit in the largest page (padded).

    Raises ValueError naming the spec when a page does not divide the largest
    one, or a Mamba state is larger than every attention page (not shared)."""
    specs = list(specs)
    if not specs:
        raise ValueError("specs must be non-empty")
    attention = [s for s in specs if isinstance(s, AttentionSpec)]
    target = max(_page_bytes(s) for s in (attention or specs))
    out = []
    for i, spec in enumerate(specs):
        page = _page_bytes(spec)
        if isinstance(spec, MambaSpec):
            if page > target:
                raise ValueError(f"specs[{i}] is a Mamba state of {page} bytes, larger than the attention page "
                                 f"of {target} bytes; raise the attention block_size so its page holds the state")
            out.append(spec)
        elif target % page:
            raise ValueError(f"specs[{i}] has a page of {page} bytes, which does not divide the largest page "
                             f"({target} bytes); groups share one pool, so their pages must be equal")
        else:
            out.append(dataclasses.replace(spec, block_size=spec.block_size * (target // page)))
    return out


def make_kv_cache_groups(layer_specs: Sequence[KVCacheSpec]) -> list[KVCacheGroup]:
    """Group model layers (``layer_specs[i]`` is layer i's spec) for a shared pool.

    Layers with equal specs form one kind; every kind is split into groups of
    ``group_size`` layers (the smallest kind's layer count; the last group of
    a kind may be shorter, its tensor slots then stay unused), so that each
    block id is one page in each of ``group_size`` shared tensors. Kinds appear
    in order of their first layer; full attention first within ties is not
    needed (hits iterate to a fixed point)."""
    if not layer_specs:
        raise ValueError("layer_specs must be non-empty")
    kinds: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(layer_specs):
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"layer_specs[{i}] must be a KVCacheSpec, got {type(spec).__name__}")
        kinds.setdefault(spec, []).append(i)
    group_size = min(len(v) for v in kinds.values())
    groups = []
    for spec, layers in kinds.items():
        for start in range(0, len(layers), group_size):
            groups.append(KVCacheGroup(spec, tuple(layers[start:start + group_size])))
    return groups


class GroupBlockHashes(Sequence):
    """A request's block hashes as one group sees them: group block ``i``
    (``k`` request blocks) is named by request hash ``(i + 1) * k - 1``, tagged
    with the group id so groups never share an index entry. Lazy: O(1) per item."""

    __slots__ = ("_base", "_k", "_tag")

    def __init__(self, base: Sequence[BlockHash], k: int, group_id: int) -> None:
        self._base, self._k, self._tag = base, k, group_id.to_bytes(2, "little")

    def __len__(self) -> int:
        return len(self._base) // self._k

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._base[(i + 1) * self._k - 1] + self._tag


def check_groups(groups: Sequence[KVCacheGroup | KVCacheSpec]) -> tuple[list[KVCacheGroup], int, int]:
    """Validate groups for a shared pool; returns (groups, hash_block_size, lcm block size)."""
    if isinstance(groups, (KVCacheGroup, KVCacheSpec)) or not groups:
        raise ValueError("groups must be a non-empty sequence of KVCacheGroup (or KVCacheSpec)")
    groups = [g if isinstance(g, KVCacheGroup) else KVCacheGroup(g) for g in groups]
    for i, g in enumerate(groups):
        if not isinstance(g.spec, KVCacheSpec):
            raise TypeError(f"groups[{i}].spec must be a KVCacheSpec, got {type(g.spec).__name__}")
    if len(groups) > 65535:
        raise ValueError(f"{len(groups)} groups: at most 65535")
    attention_pages = {_page_bytes(g.spec) for g in groups if not isinstance(g.spec, MambaSpec)}
    if len(attention_pages) > 1:
        raise ValueError(f"groups have attention pages of {sorted(attention_pages)} bytes; groups share one pool, "
                         "so pages must be equal (see unify_page_sizes)")
    if attention_pages:
        page = attention_pages.pop()
        for i, g in enumerate(groups):
            if isinstance(g.spec, MambaSpec) and _page_bytes(g.spec) > page:
                raise ValueError(f"groups[{i}] is a Mamba state of {_page_bytes(g.spec)} bytes, larger than "
                                 f"the attention page ({page} bytes)")
    sizes = [g.spec.block_size for g in groups]
    hash_bs = min(sizes)
    for i, s in enumerate(sizes):
        if s % hash_bs:
            raise ValueError(f"groups[{i}].spec.block_size={s} is not a multiple of the smallest group block "
                             f"size {hash_bs}; requests are hashed in blocks of {hash_bs} tokens")
    return groups, hash_bs, math.lcm(*sizes)


class HybridKVCacheManager(KVEventSource):
    """Blocks of several KV-cache groups, one shared pool, one table per group.

    Args:
        groups: :class:`KVCacheGroup` objects (or bare specs), see the module
            doc for the page-size and block-size rules.
        num_blocks, enable_caching, max_model_len, watermark, eviction_policy,
        block_pool: as for :class:`~servelab.blocks.KVCacheManager`.

    Attributes:
        groups: the validated groups.
        spec: the first group's spec (what a single-spec caller reads).
        block_size: the hash block size (smallest group block size).
        hit_alignment: prefix hits are multiples of this (lcm of block sizes).
    """

    def __init__(self, groups: Sequence[KVCacheGroup | KVCacheSpec], num_blocks: int, enable_caching: bool = True,
                 *, max_model_len: int | None = None, watermark: float = 0.0,
                 eviction_policy: str | EvictionPolicy | None = None, block_pool: BlockPoolProtocol | None = None,
                 kv_events: bool = False,
                 kv_event_subscribers: Iterable[KVEventSubscriber] | KVEventSubscriber | None = None) -> None:
        self.groups, self.block_size, self.hit_alignment = check_groups(groups)
        publisher = make_publisher(kv_events, kv_event_subscribers)
        check_bool("enable_caching", enable_caching)
        if max_model_len is not None:
            check_int("max_model_len", max_model_len, min_value=1)
        check_number("watermark", watermark, min_value=0.0, max_value=1.0, max_exclusive=True)
        check_int("num_blocks", num_blocks)
        for g in self.groups:  # refuse before building anything
            group_manager(g.spec, None, enable_caching)
        if block_pool is None:
            block_pool = BlockPool(num_blocks, enable_caching,
                                   eviction_policy="lru" if eviction_policy is None else eviction_policy)
        elif eviction_policy is not None:
            raise ValueError("eviction_policy applies to the pool the manager builds; with block_pool= "
                             "give the policy to that BlockPool instead")
        check_conforms(block_pool, BlockPoolProtocol, "block_pool")  # any pool, as KVCacheManager takes
        if not isinstance(block_pool.null_block, KVCacheBlock):
            raise TypeError(f"block_pool ({type(block_pool).__name__}) hands out {type(block_pool.null_block).__name__} "
                            "blocks; this manager needs KVCacheBlock objects")
        if block_pool.num_blocks != num_blocks or block_pool.enable_caching != enable_caching:
            raise ValueError("block_pool must have the manager's num_blocks and enable_caching")
        if block_pool.num_free_blocks != block_pool.num_blocks - 1:
            raise ValueError("a pool is handed over with every block free")
        owner = getattr(block_pool, "_owner", None)
        if owner is not None and owner() is not None:
            raise ValueError("block_pool already belongs to another manager; one pool has one owner")
        block_pool._owner = weakref.ref(self)
        self._pool = block_pool
        if publisher is not None:
            block_pool.kv_event_publisher = publisher
        self.spec = self.groups[0].spec
        self.specs = tuple(g.spec for g in self.groups)
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self._managers = [group_manager(g.spec, block_pool, enable_caching) for g in self.groups]
        self._ratios = [g.spec.block_size // self.block_size for g in self.groups]
        # Full attention first: its answer is usually the tightest cap.
        self._hit_order = sorted(range(len(self.groups)),
                                 key=lambda g: not isinstance(self._managers[g], FullAttentionManager))
        self.req_to_blocks: dict[str, tuple[list[KVCacheBlock], ...]] = {}
        self._num_cached_blocks: dict[str, list[int]] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # ---- queries ---------------------------------------------------------

    @property
    def block_pool(self) -> BlockPool:
        return self._pool

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self._pool.usage

    def max_chunk_alone(self, request: KVCacheRequest, num_new_tokens: int) -> int:
        """The largest chunk ``<= num_new_tokens`` with which ``request``, alone in
        the pool, reaches all its tokens by chunked prefill (0: never here; see
        :func:`~servelab.blocks.specs.max_chunk_alone`). The scheduler asks it
        before refusing a request that has the pool to itself."""
        check_int("num_new_tokens", num_new_tokens, min_value=0)
        total = check_int("request.num_tokens", request.num_tokens, min_value=0)
        return max_chunk_alone([m.spec for m in self._managers], total, self.num_blocks - 1, num_new_tokens)

    def group_hashes(self, request: KVCacheRequest, group_id: int) -> GroupBlockHashes:
        """The request's block hashes as group ``group_id`` indexes them."""
        return GroupBlockHashes(request.block_hashes, self._ratios[group_id], group_id)

    def get_block_ids(self, request: KVCacheRequest | str) -> tuple[list[int], ...]:
        """Per-group block-table rows: ``result[g]`` is group g's block ids (0 = null)."""
        request_id = request if isinstance(request, str) else request.request_id
        held = self.req_to_blocks.get(request_id)
        if held is None:
            return tuple([] for _ in self.groups)
        return tuple([b.block_id for b in blocks] for blocks in held)

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Longest prefix every group can serve: per-group blocks (not yet
        referenced) and its length in tokens (a multiple of ``hit_alignment``,
        at most ``num_tokens - 1``). No side effect."""
        _request_id(request)
        empty = tuple([] for _ in self.groups)
        if not self.enable_caching:
            return empty, 0
        num_tokens = check_int("request.num_tokens", request.num_tokens, min_value=0)
        align = self.hit_alignment
        hit_len = min(max(num_tokens - 1, 0), len(request.block_hashes) * self.block_size) // align * align
        hits: list[list[KVCacheBlock] | None] = [None] * len(self.groups)
        while True:  # each pass can only lower hit_len; stop when no group does
            lowered = False
            for g in self._hit_order:
                blocks = self._managers[g].find_longest_cache_hit(self.group_hashes(request, g), hit_len)
                served = len(blocks) * self.groups[g].spec.block_size // align * align
                if served < hit_len:
                    hit_len, lowered = served, True
                hits[g] = blocks
            if not lowered:
                break
        if hit_len == 0:
            return empty, 0
        return tuple(b[: hit_len // self.groups[g].spec.block_size] for g, b in enumerate(hits)), hit_len

    # ---- allocation --------------------------------------------------------

    def _check_hit(self, request_id: str, held, num_new_computed_tokens: int,
                   new_computed_blocks) -> list[list[KVCacheBlock]]:
        if not new_computed_blocks:
            hit = [[] for _ in self.groups]
        elif isinstance(new_computed_blocks, (tuple, list)) and len(new_computed_blocks) == len(self.groups) \
                and all(isinstance(b, (list, tuple)) for b in new_computed_blocks):
            hit = [list(b) for b in new_computed_blocks]
        else:
            raise TypeError(f"new_computed_blocks must be one block list per group ({len(self.groups)}), as "
                            "get_computed_blocks returns")
        for g, blocks in enumerate(hit):
            if len(blocks) * self.groups[g].spec.block_size != num_new_computed_tokens:
                raise ValueError(f"num_new_computed_tokens={num_new_computed_tokens} must equal "
                                 f"len(new_computed_blocks[{g}]) * {self.groups[g].spec.block_size} "
                                 f"(got {len(blocks)} blocks)")
        if num_new_computed_tokens and held:
            raise ValueError(f"new_computed_blocks given for request {request_id!r}, which already holds "
                             "blocks; prefix hits apply on admission only")
        for blocks in hit:
            for b in blocks:
                if not isinstance(b, KVCacheBlock) or self._pool.blocks[b.block_id] is not b:
                    raise TypeError(f"new_computed_blocks must hold this pool's KVCacheBlock objects, got {b!r}")
        return hit

    def allocate_slots(self, request: KVCacheRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Sequence[Sequence[KVCacheBlock]] | None = None,
                       num_lookahead_tokens: int = 0) -> tuple[list[KVCacheBlock], ...] | None:
        """Hold slots in every group for ``request.num_computed_tokens +
        num_new_computed_tokens + num_new_tokens + num_lookahead_tokens`` tokens.
        ``new_computed_blocks`` is ``get_computed_blocks``'s per-group tuple.
        Returns the per-group new blocks, or None (nothing changed) when they
        don't fit in the shared pool. Never indexes a block."""
        check_int("num_new_tokens", num_new_tokens, min_value=0)
        check_int("num_new_computed_tokens", num_new_computed_tokens, min_value=0)
        check_int("num_lookahead_tokens", num_lookahead_tokens, min_value=0)
        request_id = _request_id(request)
        held = self.req_to_blocks.get(request_id)
        hit = self._check_hit(request_id, held, num_new_computed_tokens, new_computed_blocks)
        computed = check_int("request.num_computed_tokens", request.num_computed_tokens, min_value=0)
        real = computed + num_new_computed_tokens + num_new_tokens
        num_slots = real + num_lookahead_tokens
        if self.max_model_len is not None:
            if real > self.max_model_len:
                raise ValueError(f"request {request_id!r} would reach {real} tokens, over "
                                 f"max_model_len={self.max_model_len}")
            num_slots = min(num_slots, self.max_model_len)

        # Plan, per group: released (out-of-window) blocks, blocks to allocate.
        plans, released, counts = [], [], []
        for g, manager in enumerate(self._managers):
            blocks = held[g] if held else []
            plan, rel = blocks, []
            if held and not num_new_computed_tokens and manager.releases_blocks:
                plan = blocks.copy()
                rel = manager.release_skipped_blocks(plan, computed)
            plans.append(plan)
            released.append(rel)
            counts.append(max(manager.num_required_blocks(num_slots) - len(blocks) - len(hit[g]), 0))
        num_revived = sum(1 for blocks in hit for b in blocks if b.ref_cnt == 0 and not b.is_null)
        budget = self._pool.num_free_blocks + sum(1 for rel in released for b in rel if b.ref_cnt == 1)
        if not held and self.req_to_blocks.keys() - {request_id}:
            budget -= self.watermark_blocks
        if sum(counts) + num_revived > budget:
            return None

        # Commit: take the hit, release, then allocate in group order.
        pool = self._pool
        for blocks in hit:
            pool.touch(blocks)
        for rel in released:
            if rel:
                pool.free_blocks(rel)
        fresh = pool.get_new_blocks(sum(counts))
        new_blocks, start = [], 0
        for n in counts:
            new_blocks.append(fresh[start:start + n])
            start += n
        if held is None:
            self.req_to_blocks[request_id] = tuple(h + n for h, n in zip(hit, new_blocks))
            if num_new_computed_tokens:
                self._num_cached_blocks[request_id] = [len(h) for h in hit]
        else:
            for g, blocks in enumerate(held):
                if released[g]:
                    blocks[:] = plans[g]
                blocks.extend(new_blocks[g])
        if held is None and self.enable_caching:
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queried_tokens += request.num_tokens
            stats.hit_tokens += num_new_computed_tokens
        return tuple(new_blocks)

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """Index, in every group, the full blocks covering the first
        ``num_computed_tokens`` tokens (their KV is written). Incremental,
        idempotent; no-op with caching off or for a request holding nothing."""
        check_int("num_computed_tokens", num_computed_tokens, min_value=0)
        if not self.enable_caching:
            return
        request_id = _request_id(request)
        held = self.req_to_blocks.get(request_id)
        if held is None:
            return
        limit = min(request.num_tokens, min(len(b) * g.spec.block_size for b, g in zip(held, self.groups)))
        if num_computed_tokens > limit:
            raise ValueError(f"num_computed_tokens={num_computed_tokens} exceeds request {request_id!r}'s "
                             f"{request.num_tokens} tokens or its allocated slots; only tokens whose KV was "
                             "written can be cached")
        cached = self._num_cached_blocks.setdefault(request_id, [0] * len(self.groups))
        for g, blocks in enumerate(held):
            hashes = self.group_hashes(request, g)
            num_full = min(num_computed_tokens // self.groups[g].spec.block_size, len(hashes))
            if num_full > cached[g]:
                if self._pool.kv_event_publisher is None:
                    self._pool.cache_full_blocks(blocks, hashes, cached[g], num_full)
                else:  # events name group blocks (spec.block_size tokens each) and their group
                    self._pool.cache_full_blocks(blocks, hashes, cached[g], num_full,
                                                 *event_fields(request, self.groups[g].spec.block_size), g)
                cached[g] = num_full

    def free(self, request: KVCacheRequest | str) -> None:
        """Release every block of a request: group by group, each tail first. Idempotent."""
        request_id = request if isinstance(request, str) else request.request_id
        held = self.req_to_blocks.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if held:
            for blocks in held:
                if blocks:
                    self._pool.free_blocks(blocks[::-1])

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while requests hold blocks."""
        return self._pool.reset_prefix_cache()
