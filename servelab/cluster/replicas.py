"""Data parallelism on real engines: N pipelines as processes behind the cluster ``Router`` seam.

:class:`Replicas` starts ``num_replicas`` worker processes, each holding a whole
:class:`~servelab.Pipeline` (its own scheduler, KV pool and model; a replica may itself be
tensor- or pipeline-parallel through its settings). The driver keeps what a router may
know (:class:`~servelab.cluster.router.ReplicaState`): the outstanding tokens it sent each
replica, each replica's queue lengths and KV usage as last reported, and a
:class:`~servelab.blocks.events.KVEventIndex` per replica fed only by that replica's KV-cache
events, which each replica ships with every step. The routers are the simulator's
(``round_robin``, ``least_loaded``, ``prefix_affinity``, ``consistent_hash``, or any
registered one), called exactly as :func:`~servelab.cluster.simulate_cluster` calls them,
so a routing idea runs on the simulator and on real engines with one code path.

**Admission.** :meth:`Replicas.run` routes requests in arrival order and keeps at most
``max_in_flight`` of them in the cluster (a closed loop; ``None``: all at once), or
routes each at its ``arrival_times`` entry (an open loop, as the simulator's arrivals). With
``max_in_flight=1`` every request is routed after the previous one ended and its events
arrived: a deterministic run, the same as the simulator fed arrivals far enough apart
(:func:`sequential_arrivals`), which is how ``bench/parallel.py`` compares the two.

**Faults.** A replica that dies (sentinel) or stops heartbeating fails its in-flight
requests with the reason and every later request routed to it; the others go on.
:meth:`Replicas.close` (also the context manager, garbage collection and interpreter
exit) stops every replica process.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from servelab.blocks.events import KVEventIndex
from servelab.blocks.hashing import RequestBlockHasher
from servelab.cluster.router import ReplicaState, RouteRequest, get_router
from servelab.executor.interface import sigint_deferred

__all__ = ["ReplicaDeadError", "ReplicaRun", "Replicas", "RoutedOutput", "scaled_block_trace",
           "sequential_arrivals"]

HEARTBEAT_S = 0.5


class ReplicaDeadError(RuntimeError):
    """A replica process died or hung."""


@dataclass
class RoutedOutput:
    """One request's result on a replica."""

    request_id: str
    replica: int
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None


@dataclass
class ReplicaRun:
    """What :meth:`Replicas.run` returns: outputs in request order and per-replica counts."""

    router: str
    outputs: list[RoutedOutput]
    routed: list[int]
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens (the simulator's ``prefix_hit_rate``)."""
        prompt = sum(o.num_prompt_tokens for o in self.outputs)
        return sum(o.num_cached_tokens for o in self.outputs) / prompt if prompt else 0.0

    @property
    def num_failed(self) -> int:
        return sum(o.finish_reason == "error" for o in self.outputs)


def _replica_main(index: int, path: str, settings: dict[str, Any], threads: int, conn: Any, stamp: Any,
                  parent: int) -> None:
    """One replica: a pipeline stepping while it has work, shipping outputs and KV events each step."""
    from servelab.executor.multiproc import _heartbeat, _set_parent_death_signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_parent_death_signal()
    threading.Thread(target=_heartbeat, args=(stamp, parent), daemon=True).start()
    import torch

    from servelab import Pipeline

    torch.set_num_threads(threads)
    try:
        pipe = Pipeline.from_pretrained(path, **settings)
        events: list[Any] = []
        pipe.kv_cache_manager.subscribe_kv_events(lambda batch: events.extend(batch.events))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", pipe.block_size))
    while True:
        busy = pipe.has_unfinished_requests()
        if conn.poll(0 if busy else None):
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                break
            if kind == "close":
                break
            if kind == "add":
                for rid, prompt, params in payload:
                    pipe.add_request(list(prompt), params, request_id=rid, detokenize=False)
            elif kind == "reset":
                kv = pipe.kv_cache_manager
                kv.reset_prefix_cache()  # refused while requests hold blocks: the driver sees the index unchanged
                # The clear is published now, with this reply: left pending, it would reach the driver's
                # index only after the next step, so the next run's first routing would see the old cache.
                kv.publish_kv_events(time.time())
                conn.send(("step", [], events[:], _load(pipe)))
                events.clear()
            continue
        finished = []
        for event in pipe.step():
            if event.finished:
                out = pipe.get_output(event.request_id, pop=True)
                m = out.metrics
                finished.append(RoutedOutput(out.request_id, index, list(out.token_ids), out.finish_reason,
                                             len(out.prompt_token_ids), m.num_cached_tokens if m else 0, out.error))
        conn.send(("step", finished, events[:], _load(pipe)))
        events.clear()
    pipe.close()


def _load(pipe: Any) -> tuple[int, int, float]:
    sched = pipe.scheduler
    return len(getattr(sched, "waiting", ())), len(getattr(sched, "running", ())), pipe.kv_cache_manager.usage


class _Replica:
    def __init__(self, index: int, proc: Any, conn: Any, stamp: Any) -> None:
        self.index, self.proc, self.conn, self.stamp = index, proc, conn, stamp
        self.kv_index = KVEventIndex()
        self.num_waiting = self.num_running = 0
        self.kv_usage = 0.0
        self.outstanding = 0
        self.in_flight: dict[str, int] = {}  # request id -> tokens counted in outstanding
        self.dead: str | None = None

    def state(self, request: RouteRequest) -> ReplicaState:
        return ReplicaState(self.index, self.num_waiting, self.num_running, self.outstanding, self.kv_usage,
                            (), self.kv_index, request)


class Replicas:
    """``num_replicas`` pipelines of the checkpoint ``path`` as processes behind a router.

    Args:
        path: a checkpoint folder every replica loads.
        num_replicas: how many (>= 1).
        threads_per_replica: torch threads in each replica.
        heartbeat_timeout_s: a replica silent for longer is declared hung.
        **settings: each replica's :class:`~servelab.Pipeline` settings (``num_blocks=``,
            ``block_size=``, ``tensor_parallel_size=`` ...); prefix caching is on unless
            ``enable_prefix_caching=False``.
    """

    def __init__(self, path: Any, num_replicas: int, *, threads_per_replica: int = 1,
                 heartbeat_timeout_s: float = 10.0, **settings: Any) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas!r} is invalid; valid: an int >= 1")
        if settings.get("data_parallel_size", 1) != 1:
            raise ValueError("data_parallel_size is what num_replicas sets; leave it out of the replica settings")
        from servelab.config import PipelineConfig

        PipelineConfig().replace(**settings)  # every setting checked here, before any process starts
        import torch.multiprocessing as tmp

        from servelab.executor.multiproc import _main_not_rerun

        settings = {"enable_prefix_caching": True, **settings}
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._next_id = 0
        self.replicas: list[_Replica] = []
        ctx = tmp.get_context("spawn")
        self._finalizer = weakref.finalize(self, _stop, self.replicas)
        try:
            for i in range(num_replicas):
                parent, child = ctx.Pipe(duplex=True)
                stamp = ctx.Value("d", time.time(), lock=False)
                proc = ctx.Process(target=_replica_main, args=(i, str(path), settings, threads_per_replica, child,
                                                               stamp, os.getpid()),
                                   name=f"servelab-replica{i}", daemon=True)
                with _main_not_rerun():
                    proc.start()
                child.close()
                self.replicas.append(_Replica(i, proc, parent, stamp))
            sizes = set()
            for rep in self.replicas:
                kind, value = rep.conn.recv()
                if kind != "ready":
                    raise RuntimeError(f"replica {rep.index} failed to start: {value}")
                sizes.add(value)
            self.block_size = sizes.pop()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every replica process (idempotent)."""
        self._finalizer()

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def reset_prefix_caches(self) -> None:
        """Empty every replica's prefix cache (between runs that compare routers)."""
        live = self._live()
        for rep in live:
            rep.conn.send(("reset", None))
        for rep in live:
            self._receive(rep, {})
            if rep.dead is None and rep.kv_index.hashes:
                raise RuntimeError(f"replica {rep.index} still reports {len(rep.kv_index.hashes)} cached blocks "
                                   "after a prefix-cache reset")

    def _live(self) -> list[_Replica]:
        return [r for r in self.replicas if r.dead is None]

    def run(self, prompts: Sequence[Sequence[int]], params: Any, *, router: Any = "round_robin",
            router_kwargs: dict[str, Any] | None = None, max_in_flight: int | None = None,
            arrival_times: Sequence[float] | None = None, request_ids: Sequence[str] | None = None) -> ReplicaRun:
        """Route and serve ``prompts`` (token ids, in arrival order) with ``params`` (one
        :class:`~servelab.SamplingParams` or one per prompt); see the module docstring.
        ``arrival_times`` (seconds after the call, non-decreasing): request ``i`` is routed
        no earlier than ``arrival_times[i]`` (an open loop, as the simulator's arrivals)."""
        router_obj = get_router(router, **(router_kwargs or {})) if isinstance(router, str) else get_router(router)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params has {len(plist)} entries for {len(prompts)} prompts")
        if request_ids is None:  # fresh ids: a replica refuses an id that just finished there
            first, self._next_id = self._next_id, self._next_id + len(prompts)
            request_ids = [f"dp-{first + i}" for i in range(len(prompts))]
        ids = list(request_ids)
        if max_in_flight is not None and (isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int)
                                          or max_in_flight < 1):
            raise ValueError(f"max_in_flight={max_in_flight!r} is invalid; valid: None or an int >= 1")
        if arrival_times is not None and (len(arrival_times) != len(prompts)
                                          or any(b < a for a, b in zip(arrival_times, arrival_times[1:]))):
            raise ValueError(f"arrival_times must be {len(prompts)} non-decreasing seconds, one per prompt")
        results: dict[str, RoutedOutput] = {}
        routed = [0] * len(self.replicas)
        start, nxt = time.monotonic(), 0
        limit = max_in_flight or len(prompts) or 1
        while len(results) < len(prompts):
            in_flight = sum(len(r.in_flight) for r in self.replicas)
            batches: dict[int, list[Any]] = {}
            now = time.monotonic() - start
            while nxt < len(prompts) and in_flight < limit and (arrival_times is None
                                                                 or arrival_times[nxt] <= now):
                rid, prompt = ids[nxt], list(prompts[nxt])
                rep = self._route(router_obj, rid, prompt, plist[nxt], results)
                if rep is not None:
                    routed[rep.index] += 1
                    batches.setdefault(rep.index, []).append((rid, prompt, plist[nxt]))
                    in_flight += 1
                nxt += 1
            for index, batch in batches.items():
                self._send(self.replicas[index], ("add", batch), results)
            wait_s = HEARTBEAT_S
            if arrival_times is not None and nxt < len(prompts):
                wait_s = min(wait_s, max(0.0, arrival_times[nxt] - (time.monotonic() - start)))
            self._poll(results, wait_s, idle=arrival_times is not None)
        wall = time.monotonic() - start
        name = router if isinstance(router, str) else type(router).__name__
        return ReplicaRun(name, [results[rid] for rid in ids], routed, wall)

    def _route(self, router: Any, rid: str, prompt: list[int], params: Any,
               results: dict[str, RoutedOutput]) -> _Replica | None:
        hasher = RequestBlockHasher(self.block_size)
        hasher.update(prompt)
        max_tokens = int(getattr(params, "max_tokens", 0) or 0)
        request = RouteRequest(rid, prompt, hasher.block_hashes, self.block_size, max_tokens)
        choice = router.choose(request, [r.state(request) for r in self.replicas])
        if type(choice) is not int or not 0 <= choice < len(self.replicas):
            raise ValueError(f"router {router!r} returned {choice!r}; valid: an int in range({len(self.replicas)})")
        rep = self.replicas[choice]
        if rep.dead is not None:
            results[rid] = RoutedOutput(rid, choice, [], "error", len(prompt), 0, rep.dead)
            return None
        tokens = len(prompt) + max_tokens
        rep.outstanding += tokens
        rep.in_flight[rid] = tokens
        return rep

    def _send(self, rep: _Replica, message: Any, results: dict[str, RoutedOutput]) -> None:
        try:
            with sigint_deferred():  # a half-written message would desynchronise the pipe
                rep.conn.send(message)
        except OSError as exc:
            self._fail(rep, f"replica {rep.index} cannot be reached ({exc})", results)

    def _poll(self, results: dict[str, RoutedOutput], wait_s: float = HEARTBEAT_S, idle: bool = False) -> None:
        """Take the replicas' step messages for up to ``wait_s``; with nothing in flight, sleep
        ``wait_s`` when ``idle`` (an open loop waiting for its next arrival), else return."""
        live = self._live()
        if not any(r.in_flight for r in live):
            if idle:
                time.sleep(wait_s)
            return
        handles = {r.conn: r for r in live}
        sentinels = {r.proc.sentinel: r for r in live}
        for handle in wait([*handles, *sentinels], timeout=wait_s):
            if handle in sentinels:
                rep = sentinels[handle]
                rep.proc.join(1.0)
                self._fail(rep, f"replica {rep.index} died (exit code {rep.proc.exitcode})", results)
            elif handles[handle].dead is None:
                self._receive(handles[handle], results)
        now = time.time()
        for rep in self._live():
            if now - rep.stamp.value > self.heartbeat_timeout_s:
                self._fail(rep, f"replica {rep.index} is unresponsive (no heartbeat for "
                                f"{now - rep.stamp.value:.1f} s)", results)

    def _receive(self, rep: _Replica, results: dict[str, RoutedOutput]) -> None:
        try:
            while True:
                with sigint_deferred():  # read and booked whole, or not read
                    kind, finished, events, load = rep.conn.recv()
                    rep.kv_index.apply(events)
                    rep.num_waiting, rep.num_running, rep.kv_usage = load
                    for out in finished:
                        rep.outstanding -= rep.in_flight.pop(out.request_id, 0)
                        results[out.request_id] = out
                if not rep.conn.poll(0):
                    return
        except (EOFError, OSError):
            self._fail(rep, f"replica {rep.index} closed its pipe (it died)", results)

    def _fail(self, rep: _Replica, reason: str, results: dict[str, RoutedOutput]) -> None:
        rep.dead = rep.dead or reason
        for rid in list(rep.in_flight):
            results[rid] = RoutedOutput(rid, rep.index, [], "error", 0, 0, rep.dead)
        rep.in_flight.clear()
        rep.outstanding = 0
        _stop([rep])


def _stop(replicas: list[_Replica]) -> None:
    for rep in replicas:
        try:
            rep.conn.send(("close", None))
        except OSError:
            pass
    for rep in replicas:
        rep.proc.join(2.0)
        if rep.proc.is_alive():
            rep.proc.kill()
            rep.proc.join(2.0)
        try:
            rep.conn.close()
        except OSError:
            pass


def scaled_block_trace(trace: Sequence[Any], *, tokens_per_block: int, source_block: int, vocab_size: int,
                       max_tokens: int, first_token: int = 3) -> list[tuple[list[int], int]]:
    """A block-hashed trace (Mooncake's ``hash_ids``) at a smaller scale: every source block
    of ``source_block`` tokens becomes ``tokens_per_block`` tokens drawn from a generator
    seeded by its hash id (the same id always gives the same tokens; ids ``>= first_token``
    so no special token appears), the last partial block proportionally shorter, and the
    output budget capped at ``max_tokens``. So the trace's prefix sharing is kept block for
    block, with prompts a model of a few hundred positions can serve. Returns
    ``(prompt token ids, max_tokens)`` per request."""
    import numpy as np

    out = []
    for req in trace:
        hash_ids = list(req.prompt_token_ids.hash_ids)
        length = len(req.prompt_token_ids)
        tail = length - source_block * (len(hash_ids) - 1)
        prompt: list[int] = []
        for k, h in enumerate(hash_ids):
            block = np.random.default_rng(h).integers(first_token, vocab_size, tokens_per_block).tolist()
            if k == len(hash_ids) - 1:
                block = block[: max(1, round(tail * tokens_per_block / source_block))]
            prompt.extend(block)
        out.append((prompt, max(1, min(max_tokens, req.max_tokens))))
    return out


def sequential_arrivals(requests: Sequence[tuple[list[int], int]], gap_s: float = 1000.0) -> list[Any]:
    """Simulator requests (:class:`~servelab.scheduling.simulator.workload.TraceRequest`) arriving
    ``gap_s`` apart: each served before the next arrives, as :meth:`Replicas.run` with
    ``max_in_flight=1``."""
    from servelab.scheduling.simulator.workload import TraceRequest

    return [TraceRequest(f"dp-{i}", i * gap_s, prompt, max_tokens) for i, (prompt, max_tokens) in enumerate(requests)]
