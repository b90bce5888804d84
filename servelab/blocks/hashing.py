"""Chained block hashing for prefix caching.

A block's hash covers its own tokens *and*, through its parent's hash, every
token before it::

    hash_i = H(hash_{i-1}, tokens of block i, extra keys of block i)
    hash_{-1} = NONE_HASH

so two requests share block i's hash only if they agree on the whole prefix
(and on the extra keys: adapter, cache salt, multimodal inputs). Only *full*
blocks are hashed: a partial block's content is still changing.

Two hash functions:

- ``"sha256"`` (default): collision resistant, and its ``NONE_HASH`` comes from
  a fixed seed, so separate processes agree on hashes and could share a cache.
- ``"xxhash"``: xxh3-128, several times faster, not collision resistant. Its
  seed is random per process, so an attacker cannot precompute colliding
  prompts — unless ``PYTHONHASHSEED`` is set, in which case the seed derives
  from it (reproducible runs, cross-process sharing, at the cost of that
  protection).

Inputs are serialized with ``pickle`` protocol 5 (deterministic for tuples of
ints, strings and bytes), then hashed; hashes are ``bytes``.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from servelab._internal.validation import check_int

BlockHash = bytes
HashFunction = Callable[[bytes], BlockHash]

HASH_FUNCTIONS: dict[str, HashFunction] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "xxhash": lambda data: xxhash.xxh3_128_digest(data),
}

NONE_HASH: BlockHash = hashlib.sha256(b"servelab/NONE_HASH").digest()
"""Parent hash of every request's first block under sha256 (fixed seed)."""


def _fast_hash_seed() -> bytes:
    env_seed = os.environ.get("PYTHONHASHSEED")
    if env_seed is not None and env_seed != "random":
        return f"servelab/NONE_HASH/{env_seed}".encode()
    return os.urandom(32)


_NONE_HASHES: dict[str, BlockHash] = {
    "sha256": NONE_HASH,
    "xxhash": xxhash.xxh3_128_digest(_fast_hash_seed()),
}


def none_hash(hash_fn: str = "sha256") -> BlockHash:
    """The parent hash of a first block under ``hash_fn``."""
    if hash_fn not in _NONE_HASHES:
        raise ValueError(f"hash_fn={hash_fn!r} is not known; valid: {sorted(HASH_FUNCTIONS)}")
    return _NONE_HASHES[hash_fn]


def hash_block_tokens(
    parent_hash: BlockHash,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
    hash_fn: str = "sha256",
) -> BlockHash:
    """Hash one block given its parent's hash, its token ids and extra keys."""
    if hash_fn not in HASH_FUNCTIONS:
        raise ValueError(f"hash_fn={hash_fn!r} is not known; valid: {sorted(HASH_FUNCTIONS)}")
    payload = pickle.dumps((parent_hash, tuple(token_ids), extra_keys), protocol=5)
    return HASH_FUNCTIONS[hash_fn](payload)


@dataclass(frozen=True)
class MultiModalSpan:
    """A multimodal input (image, audio clip...) occupying placeholder tokens
    ``[offset, offset + length)`` of the prompt, identified by a content hash."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise ValueError(f"identifier={self.identifier!r} must be a non-empty string")
        check_int("offset", self.offset, min_value=0)
        check_int("length", self.length, min_value=1)


def block_extra_keys(
    block_start: int,
    block_end: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_spans: Sequence[MultiModalSpan] = (),
) -> tuple | None:
    """Extra keys for the block covering tokens ``[block_start, block_end)``.

    - the adapter name, so two LoRAs never share KV;
    - the cache salt on the *first* block only: the chain carries it to every
      later block, and salting only the root keeps hashing cheap;
    - each multimodal input overlapping the block, as ``(identifier, offset
      relative to block_start)``: the same image at a different place in the
      block is different content. A span starting before the block gives a
      negative offset.
    Returns None when there is nothing to add (the common case).
    """
    keys: list = []
    if lora_name is not None:
        keys.append(("lora", lora_name))
    if cache_salt is not None and block_start == 0:
        keys.append(("salt", cache_salt))
    for span in mm_spans:
        if span.offset < block_end and span.offset + span.length > block_start:
            keys.append(("mm", span.identifier, span.offset - block_start))
    return tuple(keys) if keys else None


class RequestBlockHasher:
    """Incremental hashes of one request's full blocks.

    Call :meth:`update` with the request's whole token list whenever it grows;
    only blocks that became full since the last call are hashed. The result is
    identical to hashing the final sequence from scratch.
    """

    def __init__(
        self,
        block_size: int,
        hash_fn: str = "sha256",
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_spans: Sequence[MultiModalSpan] = (),
    ) -> None:
        check_int("block_size", block_size, min_value=1)
        if hash_fn not in HASH_FUNCTIONS:
            raise ValueError(f"hash_fn={hash_fn!r} is not known; valid: {sorted(HASH_FUNCTIONS)}")
        for name, value in (("lora_name", lora_name), ("cache_salt", cache_salt)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.mm_spans = tuple(mm_spans)
        self.block_hashes: list[BlockHash] = []

    def update(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hash the newly full blocks of ``token_ids`` (the whole sequence so
        far); returns the new hashes, also appended to ``block_hashes``."""
        bs = self.block_size
        first_new = len(self.block_hashes)
        num_full = len(token_ids) // bs
        if num_full < first_new:
            raise ValueError(
                f"token_ids has {len(token_ids)} tokens, fewer than the {first_new} blocks already hashed; "
                "a request's tokens only grow"
            )
        parent = self.block_hashes[-1] if self.block_hashes else none_hash(self.hash_fn)
        new_hashes = []
        # hash_block_tokens inlined (same bytes: the pickled (parent, tokens, extra keys) triple); a
        # request with no adapter, salt or multimodal input has no extra keys on any block.
        digest, dumps = HASH_FUNCTIONS[self.hash_fn], pickle.dumps
        plain = self.lora_name is None and self.cache_salt is None and not self.mm_spans
        for i in range(first_new, num_full):
            start = i * bs
            extra = None if plain else block_extra_keys(start, start + bs, self.lora_name, self.cache_salt,
                                                        self.mm_spans)
            parent = digest(dumps((parent, tuple(token_ids[start:start + bs]), extra), protocol=5))
            new_hashes.append(parent)
        self.block_hashes.extend(new_hashes)
        return new_hashes
