"""The built-in routers (registered in :mod:`servelab.cluster.router`).

- ``round_robin``: replicas in turn, blind to load and cache.
- ``least_loaded``: fewest outstanding tokens (prompt + output budget of the
  requests sent and not finished); ties to the lowest index.
- ``prefix_affinity``: the longest cached prefix of the request, from each
  replica's KV-event index; a miss (no replica has at least ``min_hit_blocks``
  blocks of it) or a tie goes by load. A replica whose load exceeds
  ``balance_factor`` x the least loaded one's (plus ``balance_abs_tokens``) is
  skipped, so a hot prefix cannot pile everything onto one replica (the rule
  of SGLang's cache-aware router).
- ``consistent_hash``: a hash ring over the hash of the request's first
  ``prefix_blocks`` blocks (``virtual_nodes`` points per replica): the same
  prefix lands on the same replica without any cache state (the llm-d /
  SGLang "prefix hash" style), with bounded loads: a replica whose
  outstanding tokens exceed ``load_factor`` x the mean (plus one request's
  tokens) is passed over for the next one on the ring, so one hot prefix (a
  system prompt every request shares) cannot put all the work on one replica.
  ``load_factor=None`` turns the bound off. Requests shorter than one block
  go by load.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from servelab._internal.validation import check_int, check_number
from servelab.cluster.router import ReplicaState, RouteRequest


def _least_loaded(replicas: Sequence[ReplicaState]) -> int:
    best, best_load = 0, None
    for r in replicas:
        load = r.outstanding_tokens
        if best_load is None or load < best_load:
            best, best_load = r.index, load
    return best


class RoundRobinRouter:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        i = self._next % len(replicas)
        self._next = i + 1
        return i


class LeastLoadedRouter:
    name = "least_loaded"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        return _least_loaded(replicas)


class PrefixAffinityRouter:
    """See the module docstring."""

    name = "prefix_affinity"

    def __init__(self, min_hit_blocks: int = 1, balance_factor: float = 1.5,
                 balance_abs_tokens: int = 8192) -> None:
        self.min_hit_blocks = check_int("min_hit_blocks", min_hit_blocks, min_value=1)
        self.balance_factor = check_number("balance_factor", balance_factor, min_value=1.0)
        self.balance_abs_tokens = check_int("balance_abs_tokens", balance_abs_tokens, min_value=0)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        lightest = min(r.outstanding_tokens for r in replicas)
        cap = lightest * self.balance_factor + self.balance_abs_tokens
        best, best_key = -1, None
        for r in replicas:
            if r.outstanding_tokens > cap:
                continue  # too busy: a hit there would wait behind its queue
            key = (r.prefix_hit_tokens, -r.outstanding_tokens)
            if best_key is None or key > best_key:
                best, best_key = r.index, key
        if best_key is None or best_key[0] < self.min_hit_blocks * request.block_size:
            return _least_loaded(replicas)
        return best


class ConsistentHashRouter:
    """See the module docstring."""

    name = "consistent_hash"

    def __init__(self, prefix_blocks: int = 4, virtual_nodes: int = 64, load_factor: float | None = 1.25) -> None:
        self.prefix_blocks = check_int("prefix_blocks", prefix_blocks, min_value=1)
        self.virtual_nodes = check_int("virtual_nodes", virtual_nodes, min_value=1)
        self.load_factor = None if load_factor is None else check_number("load_factor", load_factor, min_value=1.0)
        self._ring: list[int] = []
        self._owner: list[int] = []
        self._num_replicas = 0

    def _build(self, n: int) -> None:
        points = sorted((int.from_bytes(hashlib.sha256(f"replica-{i}-{v}".encode()).digest()[:8], "big"), i)
                        for i in range(n) for v in range(self.virtual_nodes))
        self._ring = [p for p, _ in points]
        self._owner = [i for _, i in points]
        self._num_replicas = n

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        if len(replicas) != self._num_replicas:
            self._build(len(replicas))
        hashes = request.block_hashes
        if not hashes:
            return _least_loaded(replicas)
        key = hashes[min(self.prefix_blocks, len(hashes)) - 1]  # chained: names the whole prefix
        point = int.from_bytes(key[:8], "big")
        ring, owner = self._ring, self._owner
        pos = bisect.bisect_left(ring, point) % len(ring)
        if self.load_factor is None:
            return owner[pos]
        cap = self.load_factor * sum(r.outstanding_tokens for r in replicas) / len(replicas) \
            + request.num_prompt_tokens + request.max_tokens
        for step in range(len(ring)):  # clockwise to the first replica under the bound
            i = owner[(pos + step) % len(ring)]
            if replicas[i].outstanding_tokens <= cap:
                return i
        return owner[pos]
