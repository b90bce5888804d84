"""Per-spec block accounting, and the spec -> manager registry.

What differs between cache kinds is small and lives here:

- how many blocks ``num_tokens`` tokens need;
- how a prefix hit is found (full attention: longest run of hits from the
  start; sliding window: the rightmost run long enough to cover a window);
- which held blocks may be released while the request runs (sliding window:
  blocks wholly outside the window become the null block).

Everything else (reference counts, admission, caching) is common and lives in
``KVCacheManager``. A new spec plugs in with ``@register_spec_manager(MySpec)``
on a subclass of ``SingleTypeManager``; lookup walks the spec's MRO, so a spec
subclass inherits its parent's manager unless it registers its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from servelab.blocks.block_pool import BlockPool
from servelab.blocks.free_queue import KVCacheBlock
from servelab.blocks.hashing import BlockHash
from servelab.blocks.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec, cdiv

_MANAGERS: dict[type[KVCacheSpec], type[SingleTypeManager]] = {}


def register_spec_manager(spec_cls: type[KVCacheSpec]) -> Callable[[type], type]:
    """Class decorator: use the decorated manager for ``spec_cls`` and its
    subclasses (unless they register their own)."""
    if not (isinstance(spec_cls, type) and issubclass(spec_cls, KVCacheSpec)):
        raise TypeError(f"spec_cls must be a KVCacheSpec subclass, got {spec_cls!r}")

    def decorate(manager_cls: type) -> type:
        if not (isinstance(manager_cls, type) and issubclass(manager_cls, SingleTypeManager)):
            raise TypeError(f"{manager_cls!r} must subclass SingleTypeManager")
        _MANAGERS[spec_cls] = manager_cls
        return manager_cls

    return decorate


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeManager]:
    """The manager class registered for ``spec``'s class or its nearest base."""
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
    for cls in type(spec).__mro__:
        if cls in _MANAGERS:
            return _MANAGERS[cls]
    known = ", ".join(sorted(c.__name__ for c in _MANAGERS))
    raise ValueError(
        f"no block manager is registered for {type(spec).__name__} or any of its base classes "
        f"(registered: {known}); decorate a SingleTypeManager subclass with "
        f"@register_spec_manager({type(spec).__name__})"
    )


class SingleTypeManager:
    """Block accounting for one kind of cache. Stateless apart from the spec
    and the pool: per-request block lists are owned by ``KVCacheManager``."""

    #: Whether a prefix of a request's KV can be reused by another request.
    supports_prefix_caching: bool = True
    #: Why not, when ``supports_prefix_caching`` is False.
    no_prefix_caching_reason: str = ""
    #: Whether ``release_skipped_blocks`` can ever release anything (lets the
    #: manager skip the call on the per-step hot path).
    releases_blocks: bool = False

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool

    def num_required_blocks(self, num_tokens: int) -> int:
        """Blocks a request needs to hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """Cached blocks for the longest reusable prefix of at most
        ``max_length`` tokens (null blocks where content is not needed)."""
        raise NotImplementedError

    def release_skipped_blocks(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> list[KVCacheBlock]:
        """Replace blocks no longer needed by future tokens with the null block,
        in place; return the released blocks in the order to free them."""
        return []


@register_spec_manager(FullAttentionSpec)
class FullAttentionManager(SingleTypeManager):
    """Every token sees every earlier token: a hit is a run of cached blocks
    from the start, and nothing is released early. Also serves MLA (its spec
    subclasses ``FullAttentionSpec``)."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        hit: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit


@register_spec_manager(SlidingWindowSpec)
class SlidingWindowManager(SingleTypeManager):
    """Position p sees keys j with p - j < window. A prefix of length L is
    reusable if the blocks covering its last ``window - 1`` tokens are cached;
    earlier blocks may be missing (null)."""

    releases_blocks = True

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        max_blocks = min(max_length // self.block_size, len(block_hashes))
        # A prefix ends on a block boundary, so its last window-1 tokens span
        # exactly this many whole blocks.
        needed = cdiv(self.spec.sliding_window - 1, self.block_size)
        null = self.block_pool.null_block
        if needed == 0:
            return [null] * max_blocks
        run: list[KVCacheBlock] = []
        # Scan right to left: the longest prefix wins, so the rightmost run
        # of `needed` hits (or a shorter run reaching block 0) decides.
        for i in range(max_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[i])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == needed:
                return [null] * i + run[::-1]
        return run[::-1]

    def release_skipped_blocks(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> list[KVCacheBlock]:
        # The next token to compute sits at num_computed_tokens and sees back to
        # num_computed_tokens - window + 1; blocks wholly before that are dead.
        first_useful_token = num_computed_tokens - self.spec.sliding_window + 1
        last_dead_block = first_useful_token // self.block_size - 1
        released = []
        null = self.block_pool.null_block
        for i in range(min(last_dead_block, len(blocks) - 1), -1, -1):
            if blocks[i].is_null:
                break  # everything before was released earlier
            released.append(blocks[i])
            blocks[i] = null
        return released


@register_spec_manager(MambaSpec)
class MambaManager(SingleTypeManager):
    """A recurrent state of fixed size: one block per request, whatever its length."""

    supports_prefix_caching = False
    no_prefix_caching_reason = (
        "a Mamba state summarizes the whole prefix in place and is overwritten every step, "
        "so no block holds a reusable prefix; pass enable_caching=False"
    )

    def num_required_blocks(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        return []


class MambaStateManager(SlidingWindowManager):
    """A Mamba group with prefix caching: one state block per ``block_size``
    tokens (the kernel writes the state at each block boundary into it); a
    prefix of ``L`` blocks is served by the state block ``L - 1`` alone, and
    blocks before the previous boundary are released. That is exactly a
    sliding window of ``block_size + 1`` tokens, which this reuses."""

    def __init__(self, spec: MambaSpec, block_pool: BlockPool) -> None:
        window = SlidingWindowSpec(block_size=spec.block_size, num_kv_heads=1, head_size=1,
                                   dtype=torch.float32, sliding_window=spec.block_size + 1)
        super().__init__(window, block_pool)
        self.state_spec = spec


def group_manager(spec: KVCacheSpec, pool: BlockPool, enable_caching: bool) -> SingleTypeManager:
    """The manager of one KV-cache group of ``spec`` over ``pool`` (``pool`` may be None to
    validate only); ``ValueError`` when ``enable_caching`` is asked of a spec without prefix caching."""
    if isinstance(spec, MambaSpec) and enable_caching:
        return MambaStateManager(spec, pool)
    cls = manager_class_for(spec)
    if enable_caching and not cls.supports_prefix_caching:
        raise ValueError(f"enable_caching=True is not supported for {type(spec).__name__}: "
                         f"{cls.no_prefix_caching_reason}")
    return cls(spec, pool)
