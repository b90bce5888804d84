"""Prefix-cache statistics of a KV cache manager (their own module, so the block layer's
interfaces can name them without importing a manager)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrefixCacheStats"]


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset, counted in tokens, once per admission."""

    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
