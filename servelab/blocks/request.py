"""What the KV layer needs to know about a request, and a minimal one.

``KVCacheManager`` reads four attributes of a request and nothing else; any
object with them works (the scheduler's ``Request`` is one). ``TokenSequence``
is the smallest such object: a token list that hashes its full blocks as it
grows. Tests, the block-layer demo and the benchmarks use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from servelab.blocks.hashing import BlockHash, MultiModalSpan, RequestBlockHasher


@runtime_checkable
class KVCacheRequest(Protocol):
    """The view of a request that ``KVCacheManager`` works with."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far (drafts excluded)."""
        ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is already in the cache (or scheduled to be)."""
        ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """Chained hashes of the request's full blocks, in order."""
        ...


class TokenSequence:
    """A request reduced to its tokens: satisfies :class:`KVCacheRequest`."""

    def __init__(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_size: int,
        *,
        hash_fn: str = "sha256",
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_spans: Sequence[MultiModalSpan] = (),
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r} must be a non-empty string")
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self._hasher = RequestBlockHasher(block_size, hash_fn, lora_name, cache_salt, mm_spans)
        self.append_token_ids(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_hashes(self) -> list[BlockHash]:
        return self._hasher.block_hashes

    def append_token_ids(self, token_ids: Sequence[int]) -> None:
        """Grow the sequence (new output tokens); hashes newly full blocks."""
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"token id {t!r} must be a non-negative int")
        self.token_ids.extend(token_ids)
        self._hasher.update(self.token_ids)

    def __repr__(self) -> str:
        return (f"TokenSequence({self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens})")
