"""The router seam: which replica serves a request.

A :class:`Router` sees one request at a time, at its arrival, and the public
state of every replica (:class:`ReplicaState`: queue lengths, outstanding and
running tokens, KV usage, and how much of the request's prefix the replica
has cached, estimated from the KV-cache events the replica published, never
from its memory). It returns the index of the replica to send it to.

Contract (who calls what, when): the cluster calls ``router.choose(request,
replicas)`` once per request, in arrival order, on the cluster's clock;
``replicas[i].index == i``; the answer must be an int in
``range(len(replicas))`` (anything else raises ``ValueError`` naming the
router). A router may keep state between calls (round robin's counter); the
cluster builds a fresh one per simulation when given a name. Routers should
read only the ``ReplicaState`` fields they need: ``running_tokens`` and
``prefix_hit_tokens`` are computed on first access.

Registry::

    register_router(name, factory, *, override=False)  # factory(**kwargs) -> Router
    get_router(name_or_router, **kwargs)
    available_routers()   # consistent_hash, least_loaded, prefix_affinity, round_robin
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from servelab._internal.registry import Registry
from servelab.blocks.events import KVEventIndex
from servelab.blocks.hashing import BlockHash

__all__ = ["ReplicaState", "RouteRequest", "Router", "available_routers", "get_router", "register_router"]


class RouteRequest:
    """What a router knows about a request: its id, prompt, the chained hashes
    of its full prompt blocks (the keys of every replica's prefix cache),
    the output budget and the client."""

    __slots__ = ("request_id", "prompt_token_ids", "block_hashes", "block_size", "max_tokens", "client_id")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                 block_size: int, max_tokens: int, client_id: str = "default") -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.block_hashes = block_hashes
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.client_id = client_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class ReplicaState:
    """One replica's public state when a request arrives.

    Attributes:
        index: the replica's position (what ``choose`` returns).
        num_waiting, num_running: its scheduler's queue lengths.
        outstanding_tokens: prompt + output-budget tokens of the requests sent
            to it and not finished (the load measure of ``least_loaded``).
        kv_usage: fraction of its KV blocks held by requests.
        running_tokens: tokens (prompt + output so far) of its running
            requests (computed on first access).
        prefix_hit_tokens: tokens of this request's prompt prefix the replica
            has cached, from its KV-event index (computed on first access).
    """

    __slots__ = ("index", "num_waiting", "num_running", "outstanding_tokens", "kv_usage", "_running",
                 "_index", "_request", "_hit", "_running_tokens")

    def __init__(self, index: int, num_waiting: int, num_running: int, outstanding_tokens: int, kv_usage: float,
                 running: Sequence[Any] = (), kv_index: KVEventIndex | None = None,
                 request: RouteRequest | None = None) -> None:
        self.index = index
        self.num_waiting = num_waiting
        self.num_running = num_running
        self.outstanding_tokens = outstanding_tokens
        self.kv_usage = kv_usage
        self._running, self._index, self._request = running, kv_index, request
        self._hit: int | None = None
        self._running_tokens: int | None = None

    @property
    def running_tokens(self) -> int:
        if self._running_tokens is None:
            self._running_tokens = sum(r.num_tokens for r in self._running)
        return self._running_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        if self._hit is None:
            if self._index is None or self._request is None:
                self._hit = 0
            else:
                req = self._request
                self._hit = self._index.prefix_hit_blocks(req.block_hashes) * req.block_size
        return self._hit

    def __repr__(self) -> str:
        return (f"ReplicaState({self.index}, waiting={self.num_waiting}, running={self.num_running}, "
                f"outstanding_tokens={self.outstanding_tokens}, kv_usage={self.kv_usage:.2f})")


@runtime_checkable
class Router(Protocol):
    """Chooses the replica for each request (see the module docstring)."""

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        """Index of the replica that serves ``request``."""
        ...


def _check_router(obj: Any) -> None:
    if not callable(getattr(obj, "choose", None)):
        raise TypeError(f"a router must have a choose(request, replicas) -> int method; "
                        f"{type(obj).__name__} has none")


_ROUTERS: Registry[Router] = Registry("router", factory=True, check=_check_router)


def register_router(name: str, factory: Callable[..., Router] | str, *, override: bool = False) -> None:
    """Make ``get_router(name, **kwargs)`` build routers with ``factory(**kwargs)``
    (a class, or a lazy ``"module:attr"``). Duplicate names raise ``ValueError``
    unless ``override=True``."""
    if not (isinstance(factory, str) or callable(factory)):
        raise TypeError(f"factory must be a class or callable returning a Router, got {type(factory).__name__}")
    _ROUTERS.register(name, factory, override=override)


def get_router(name_or_router: str | Router, **kwargs: Any) -> Router:
    """A fresh router by registered name, or a router object as it is."""
    router = _ROUTERS.get(name_or_router, **kwargs)
    _check_router(router)
    return router


def available_routers() -> list[str]:
    """Registered router names, sorted."""
    return _ROUTERS.available()


for _name, _cls in (("round_robin", "RoundRobinRouter"), ("least_loaded", "LeastLoadedRouter"),
                    ("prefix_affinity", "PrefixAffinityRouter"), ("consistent_hash", "ConsistentHashRouter")):
    register_router(_name, f"servelab.cluster.routers:{_cls}")
