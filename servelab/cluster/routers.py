"""The built-in routers (registered in :mod:`servelab.cluster.router`).

- ``round_robin``: replicas in turn, blind to load and cache.
- ``least_loaded``: fewest outstanding tokens (prompt + output budget of the
  requests sent and not finished); ties to the lowest index.
- ``prefix_affinity``: the replica with the longest cached prefix of the
  request, from each replica's KV-event index, when that prefix is at least
  ``min_hit_blocks`` blocks and ``min_hit_fraction`` of the request's full
  prompt blocks; equal hits go to the less loaded. Otherwise (a miss) the
  request goes to the owner of its leading prefix on a hash ring (the first
  ``prefix_blocks`` blocks past the prefix every replica holds), so distinct
  prefixes spread over the cluster and requests sharing one land together,
  even those that arrive before the first is cached. A replica whose load
  exceeds ``balance_factor`` x the least loaded one's (plus
  ``balance_abs_tokens``) is skipped in both cases (a miss goes to the next
  replica on the ring), so a hot prefix cannot pile everything onto one
  replica (the rule of SGLang's cache-aware router). Remaining ties follow the
  request's ring order, never the replica index.

  Why not "a miss goes to the least loaded": with idle replicas (one request
  at a time) every load is 0 and the tie goes to replica 0, and then every
  later request finds a hit there (the shared first block at least), so the
  cluster serves from one replica's cache (992 of 1000 Mooncake requests on
  replica 0 of 4, a 0.79x round robin's hit rate in ``bench/parallel.py``).
  Why ``min_hit_fraction`` (0.5): a hit on a system prompt every request
  shares is no reason to give up spreading; without it the first replica to
  cache that prompt attracts everything. Why skip the prefix every replica
  holds in the ring key: when all requests share the key's blocks (a long
  system prompt, large blocks) the ring would send every miss to one owner;
  past the common part the key names the conversation. Under load misses do
  not go to the least loaded either: requests of one prefix group arriving
  together would scatter before the first is cached, losing the hits a
  shorter-than-half shared prefix gives.
- ``consistent_hash``: a hash ring over the request's first ``prefix_blocks``
  blocks (``virtual_nodes`` points per replica): the same prefix lands on the
  same replica without any cache state (the llm-d / SGLang "prefix hash"
  style), with bounded loads: a replica whose outstanding tokens exceed
  ``load_factor`` x the mean (plus one request's tokens) is passed over for the
  next one on the ring, so one hot prefix (a system prompt every request
  shares) cannot put all the work on one replica. ``load_factor=None`` turns
  the bound off.

The ring position of a request is a SHA-256 of the token ids of its first
``prefix_blocks`` full blocks (of the whole prompt when it is shorter than one
block), not of the cache's block hashes: those depend on the engine's hash
function and, for the fast one, on a per-process seed, so a ring keyed on them
would place the same prompt differently in the simulator and on real engines,
and differently in every process. Adapters (LoRA) are not part of the key.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
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


def _prefix_point(request: RouteRequest, prefix_blocks: int, skip_blocks: int = 0) -> int:
    """Ring position (a 64-bit int) of the token ids of ``request``'s first ``prefix_blocks``
    full blocks after its first ``skip_blocks``, or of all of them when fewer remain (of the
    whole prompt when nothing remains)."""
    bs = request.block_size
    tokens = request.prompt_token_ids[skip_blocks * bs:] or request.prompt_token_ids
    n = min(prefix_blocks, len(tokens) // bs) * bs
    data = array("q", tokens[:n] if n else tokens).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class _Ring:
    """``virtual_nodes`` points per replica on a 64-bit ring (rebuilt when the count changes)."""

    def __init__(self, virtual_nodes: int) -> None:
        self.virtual_nodes = virtual_nodes
        self.points: list[int] = []
        self.owners: list[int] = []
        self.num_replicas = 0

    def order(self, point: int, num_replicas: int) -> list[int]:
        """Every replica index once, clockwise from ``point`` (the first is its owner)."""
        if num_replicas != self.num_replicas:
            pts = sorted((int.from_bytes(hashlib.sha256(f"replica-{i}-{v}".encode()).digest()[:8], "big"), i)
                         for i in range(num_replicas) for v in range(self.virtual_nodes))
            self.points, self.owners = [p for p, _ in pts], [i for _, i in pts]
            self.num_replicas = num_replicas
        owners, size = self.owners, len(self.owners)
        pos = bisect.bisect_left(self.points, point)
        seen: list[int] = []
        for step in range(size):
            i = owners[(pos + step) % size]
            if i not in seen:
                seen.append(i)
                if len(seen) == num_replicas:
                    break
        return seen


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

    def __init__(self, min_hit_blocks: int = 1, min_hit_fraction: float = 0.5, balance_factor: float = 1.5,
                 balance_abs_tokens: int = 8192, prefix_blocks: int = 4, virtual_nodes: int = 64) -> None:
        self.min_hit_blocks = check_int("min_hit_blocks", min_hit_blocks, min_value=1)
        self.min_hit_fraction = check_number("min_hit_fraction", min_hit_fraction, min_value=0.0, max_value=1.0)
        self.balance_factor = check_number("balance_factor", balance_factor, min_value=1.0)
        self.balance_abs_tokens = check_int("balance_abs_tokens", balance_abs_tokens, min_value=0)
        self.prefix_blocks = check_int("prefix_blocks", prefix_blocks, min_value=1)
        self._ring = _Ring(check_int("virtual_nodes", virtual_nodes, min_value=1))

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        cap = min(r.outstanding_tokens for r in replicas) * self.balance_factor + self.balance_abs_tokens
        common = min(r.prefix_hit_tokens for r in replicas) // request.block_size  # says nothing about where
        order = self._ring.order(_prefix_point(request, self.prefix_blocks, common), len(replicas))
        # too busy: a hit there would wait behind its queue (never empty: the lightest is under the cap)
        eligible = [replicas[i] for i in order if replicas[i].outstanding_tokens <= cap]
        best = max(eligible, key=lambda r: (r.prefix_hit_tokens, -r.outstanding_tokens))  # the first of equals
        full_blocks = request.num_prompt_tokens // request.block_size
        need = max(self.min_hit_blocks, self.min_hit_fraction * full_blocks) * request.block_size
        return best.index if best.prefix_hit_tokens >= need else eligible[0].index


class ConsistentHashRouter:
    """See the module docstring."""

    name = "consistent_hash"

    def __init__(self, prefix_blocks: int = 4, virtual_nodes: int = 64, load_factor: float | None = 1.25) -> None:
        self.prefix_blocks = check_int("prefix_blocks", prefix_blocks, min_value=1)
        self.load_factor = None if load_factor is None else check_number("load_factor", load_factor, min_value=1.0)
        self._ring = _Ring(check_int("virtual_nodes", virtual_nodes, min_value=1))

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        order = self._ring.order(_prefix_point(request, self.prefix_blocks), len(replicas))
        if self.load_factor is None:
            return order[0]
        cap = self.load_factor * sum(r.outstanding_tokens for r in replicas) / len(replicas) \
            + request.num_prompt_tokens + request.max_tokens
        for i in order:  # clockwise to the first replica under the bound
            if replicas[i].outstanding_tokens <= cap:
                return i
        return order[0]
