"""The one simulation loop: replicas (a real ``Scheduler`` and ``KVCacheManager`` each), a fake
model and one virtual clock, as a discrete-event loop.

:func:`~servelab.scheduling.simulator.simulate` runs it with one replica,
:func:`~servelab.cluster.simulate_cluster` with one or many (colocated or
prefill/decode), ``simulate(engine="vllm")`` with one replica whose scheduler
is vLLM's behind an adapter (:mod:`.vllm_engine`); servelab's schedulers get
their requests from one :class:`RequestFactory`, and every step is charged by
one cost call, :func:`step_timer`'s ``time_of`` on the step's real scheduler
output.

Events, in time order (ties: arrivals first, then events in the order they
were scheduled): an *arrival* is handed to ``arrive`` (which adds it to a
replica); a *step end* applies the step's results (one fake token for each
request whose computation reached the end of its tokens; nothing for a partial
prefill) with ``update_from_output``; any other event is a callback (a P/D KV
transfer landing). After each event every replica it touched that is idle
starts a step: ``schedule()``, then a step end at ``now + time_of(output)``.
A step that schedules nothing applies the failures (and landed transfers) it
reports and leaves the replica idle until the next event touches it (it
schedules again at once if landed transfers re-queued requests or a request
preempted itself to wait for memory: no event would come for those).

What the loop does not do, because nothing reads it: it never builds a
request's ``Request`` before its arrival (a trace or generator is read
lazily), and with an arrival-ordered policy (``fcfs``) it keeps the
scheduler's waiting queue short (:attr:`Replica.backlog`): the scheduler only
ever admits from the head of such a queue, so feeding it in arrival order as
room appears changes nothing but the memory an overloaded run holds.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from servelab.blocks.hashing import RequestBlockHasher
from servelab.samplers.params import SamplingParams
from servelab.scheduling.output import ModelRunnerOutput, SchedulerOutput
from servelab.scheduling.request import Request, RequestMetrics, RequestStatus
from servelab.scheduling.scheduler import Scheduler
from servelab.scheduling.simulator.workload import TraceRequest

__all__ = ["FAKE_TOKEN", "Replica", "RequestFactory", "SimLoop", "VirtualClock", "step_timer"]

FAKE_TOKEN = 7
_ONE = [FAKE_TOKEN]
_NOTHING: list[int] = []


def is_arrival_ordered(policy: Any) -> bool:
    """True for a policy whose waiting queue is in arrival order (servelab's ``fcfs`` itself, not a
    subclass): a backlog fed to it in arrival order changes nothing."""
    from servelab.scheduling.policies import FCFSPolicy

    return type(policy) is FCFSPolicy


class VirtualClock:
    """The simulator's time; the scheduler reads it by calling it."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def step_timer(cost_model: Any) -> Callable[[Any], float]:
    """The one cost call of a run: seconds for a step, from its ``SchedulerOutput``.

    ``cost_model.timer()`` when it has one (a :class:`.cost_model.StepCostModel`:
    a fresh ``time_of`` whose step-to-step state, the decode restarts, belongs
    to this run and replica), else ``cost_model.time_of`` (a roofline, any
    stateless model), else ``step_time(num_tokens, num_kv_tokens)`` (a minimal
    two-argument model). ``TypeError`` for anything else.
    """
    timer = getattr(cost_model, "timer", None)
    if callable(timer):
        return timer()
    time_of = getattr(cost_model, "time_of", None)
    if callable(time_of):
        return time_of
    step_time = getattr(cost_model, "step_time", None)
    if callable(step_time):
        return lambda out: step_time(out.total_num_scheduled_tokens, out.total_num_kv_tokens)
    raise TypeError(f"cost_model must have time_of(scheduler_output) or step_time(num_tokens, num_kv_tokens), "
                    f"got {type(cost_model).__name__}")


class RequestFactory:
    """The scheduler ``Request`` of a trace request, built when it arrives.

    ``SamplingParams`` are shared per ``max_tokens``; block hashes use xxhash
    (the cache is private to one run: collision resistance buys nothing).
    ``prefill_only``: the prefill half of a P/D request (one output token).
    ``block_size``: hash each request's blocks here (None: the scheduler does,
    at ``add_request``); a generated prompt's shared prefix
    (:class:`.workload.PrefixedTokens`) is hashed once per workload and its
    hash chain reused by every request that starts with it.
    """

    def __init__(self, prefill_only: bool = False, block_size: int | None = None) -> None:
        self.prefill_only = prefill_only
        self.block_size = block_size
        self._params: dict[int, SamplingParams] = {}
        self._prefix_hashes: dict[int, tuple[list[int], list[Any]]] = {}  # id(prefix) -> (prefix, its hashes)

    def _hash(self, request: Request, prompt: Any) -> Request:
        """Give ``request`` its block hashes, reusing its shared prefix's chain."""
        block_size = self.block_size
        if block_size is None:
            return request
        prefix = getattr(prompt, "prefix", None) if request.lora_name is None else None  # adapters key their own
        known: list[Any] = []
        if prefix:
            entry = self._prefix_hashes.get(id(prefix))
            if entry is None or entry[0] is not prefix:
                hasher = RequestBlockHasher(block_size, "xxhash")
                hasher.update(prefix)
                entry = self._prefix_hashes[id(prefix)] = (prefix, hasher.block_hashes)
            known = entry[1]
        request.init_block_hasher(block_size, known)
        return request

    def params(self, max_tokens: int) -> SamplingParams:
        params = self._params.get(max_tokens)
        if params is None:
            params = self._params[max_tokens] = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return params

    def __call__(self, r: TraceRequest) -> Request:
        return self._hash(Request(r.request_id, r.prompt_token_ids,
                                  self.params(1 if self.prefill_only else r.max_tokens), arrival_time=r.arrival_time,
                                  priority=r.priority, client_id=r.client_id, hash_fn="xxhash",
                                  lora_name=getattr(r, "lora_name", None)), r.prompt_token_ids)

    def decode_half(self, r: TraceRequest) -> Request:
        """The decode half of a P/D request: the prompt and the prefill's first token, the rest to generate."""
        prompt = list(r.prompt_token_ids)
        prompt.append(FAKE_TOKEN)
        return self._hash(Request(r.request_id, prompt, self.params(r.max_tokens - 1), arrival_time=r.arrival_time,
                                  priority=r.priority, client_id=r.client_id, hash_fn="xxhash",
                                  lora_name=getattr(r, "lora_name", None)), r.prompt_token_ids)


class Replica:
    """One replica of a simulation: its scheduler, cache, cost call and bookkeeping."""

    def __init__(self, index: int, role: str, sched: Scheduler, kv: Any, time_of: Callable[[Any], float],
                 build: RequestFactory, *, kv_index: Any = None, backlog: bool = False) -> None:
        self.index, self.role, self.sched, self.kv, self.time_of = index, role, sched, kv, time_of
        if getattr(sched, "emit_running_outputs", None) is True:  # the loop reads ends only (_apply)
            sched.emit_running_outputs = False
        self.build, self.kv_index = build, kv_index
        self.outstanding = 0
        self.tokens_of: dict[str, int] = {}
        self.busy = False
        self.in_flight: SchedulerOutput | None = None
        self.finished: list[RequestMetrics] = []
        self.num_steps = 0
        self.kv_times: list[float] = []
        self.kv_usage: list[float] = []
        self.routed = 0
        self.link_free = 0.0  # P/D prefill replicas: when the outgoing KV link is idle again
        self.landed: set[str] = set()  # P/D decode replicas: loads landed, told at the next step end
        # requests ended before the step's schedule(): a request failed inside schedule() (one that can
        # never fit) is counted there, and its final output comes with the step's update
        self.ended_mark = 0
        # Arrivals not yet handed to the scheduler (only for an arrival-ordered policy fed in arrival
        # order: see the module docstring); None: every arrival goes straight in.
        self.backlog: deque[TraceRequest] | None = deque() if backlog else None
        # The backlog keeps this many waiting requests in the scheduler: more than one step admits.
        self.window = sched.config.max_num_seqs + 1

    def failed(self, request: Any, error: str, now: float) -> RequestMetrics:
        """The final metrics of ``request``, refused by the scheduler at ``now`` with ``error``."""
        request.status, request.error = RequestStatus.FINISHED_FAILED, error
        request.finish_time = now
        return request.metrics()

    @property
    def num_waiting(self) -> int:
        return len(self.sched.waiting) + (len(self.backlog) if self.backlog else 0)

    @property
    def has_work(self) -> bool:
        return bool(self.sched.requests or self.backlog)


class SimLoop:
    """The discrete-event loop (see the module docstring).

    Args:
        replicas: every replica.
        clock: the virtual clock the replicas' schedulers read.
        arrive: called with each arrival at its time; returns the replica it
            went to (None: it failed or went nowhere).
        on_finished: called with ``(replica, metrics)`` for every request that
            ends on a replica (the replica's ``finished`` list already has it).
        max_steps: raise ``RuntimeError`` once the replicas took this many steps
            in all with requests unfinished.
    """

    def __init__(self, replicas: list[Replica], clock: VirtualClock,
                 arrive: Callable[[TraceRequest], Replica | None],
                 on_finished: Callable[[Replica, RequestMetrics], None] | None = None,
                 max_steps: int | None = None) -> None:
        self.replicas, self.clock, self.arrive, self.on_finished = replicas, clock, arrive, on_finished
        self.max_steps = max_steps
        self.heap: list[tuple[float, int, Callable[[Any], Replica | None], Any]] = []
        self._seq = itertools.count()
        self.num_steps = 0

    def at(self, t: float, callback: Callable[[Any], Replica | None], arg: Any) -> None:
        """Call ``callback(arg)`` at time ``t``; the replica it returns (if any) is kicked."""
        heapq.heappush(self.heap, (t, next(self._seq), callback, arg))

    def run(self, arrivals: Iterable[TraceRequest]) -> None:
        """Serve ``arrivals`` (in arrival order; read lazily) until every event is done."""
        heap, clock = self.heap, self.clock
        stream: Iterator[TraceRequest] = iter(arrivals)
        nxt = next(stream, None)
        inf = math.inf
        while nxt is not None or heap:
            t_arrival = nxt.arrival_time if nxt is not None else inf
            kick: list[Replica] = []
            if heap and heap[0][0] < t_arrival:
                t, _, callback, arg = heapq.heappop(heap)
                clock.now = t
                rep = callback(arg)
                if rep is not None:
                    kick.append(rep)
            else:
                clock.now = t_arrival
                while nxt is not None and nxt.arrival_time <= t_arrival:
                    rep = self.arrive(nxt)
                    if rep is not None and rep not in kick:
                        kick.append(rep)
                    nxt = next(stream, None)
            for rep in kick:
                if not rep.busy:
                    self.start_step(rep)
        stuck = [r.index for r in self.replicas if r.has_work]
        if stuck:
            raise RuntimeError(f"replicas {stuck} still hold requests that can never be scheduled "
                               "(a prompt larger than the KV cache?)")

    # ---- requests in --------------------------------------------------------------

    def add(self, rep: Replica, trace: TraceRequest) -> bool:
        """Hand ``trace`` to ``rep`` (through its backlog when it has one). False: it failed."""
        backlog = rep.backlog
        if backlog is not None and (backlog or len(rep.sched.waiting) >= rep.window):
            backlog.append(trace)
            return True
        return self.add_request(rep, rep.build(trace))

    def add_request(self, rep: Replica, request: Request) -> bool:
        try:
            rep.sched.add_request(request)
        except ValueError as exc:  # e.g. a prompt over max_model_len: counted as failed
            self.fail(rep, request, str(exc))
            return False
        return True

    def fail(self, rep: Replica, request: Request, error: str) -> None:
        self._finished(rep, rep.failed(request, error, self.clock.now))

    def _feed(self, rep: Replica) -> None:
        """Move backlog requests into the scheduler while its waiting queue is short."""
        backlog, waiting, build = rep.backlog, rep.sched.waiting, rep.build
        while backlog and len(waiting) < rep.window:
            self.add_request(rep, build(backlog.popleft()))

    # ---- steps ----------------------------------------------------------------------

    def start_step(self, rep: Replica) -> None:
        """``rep`` is idle: schedule its next step (or apply a step that scheduled nothing)."""
        sched = rep.sched
        # An empty step ends here unless it changed what the next one sees: landed loads re-queued
        # their requests, or a request preempted itself to wait for memory a held load may give
        # back (connector_states); no event would come to retry it, so try again (a few times).
        for _ in range(3):
            if rep.backlog:
                self._feed(rep)
            if not sched.requests:
                return
            rep.ended_mark = sched.num_finished
            out = sched.schedule()
            if out.num_scheduled_tokens:
                rep.busy, rep.in_flight = True, out
                self.at(self.clock.now + rep.time_of(out), self._end_step, rep)
                return
            landed = self._take_landed(rep)
            self._apply(rep, out, ModelRunnerOutput([], [], kv_connector_output=landed))
            if landed is None and not getattr(out, "preempted_req_ids", None):
                return

    def _end_step(self, rep: Replica) -> Replica:
        out, rep.in_flight, rep.busy = rep.in_flight, None, False
        assert out is not None
        ids = list(out.num_scheduled_tokens)
        # One token for everyone: the scheduler ignores tokens given to a request mid-prefill.
        self._apply(rep, out, ModelRunnerOutput(ids, [_ONE] * len(ids), kv_connector_output=self._take_landed(rep)))
        return rep

    @staticmethod
    def _take_landed(rep: Replica) -> Any:
        if not rep.landed:
            return None
        from servelab.connectors.base import KVTransferResult

        landed, rep.landed = rep.landed, set()
        return KVTransferResult(finished_recving=landed)

    def _apply(self, rep: Replica, out: SchedulerOutput, model_out: ModelRunnerOutput) -> None:
        sched = rep.sched
        outputs = sched.update_from_output(out, model_out)
        if sched.num_finished != rep.ended_mark:  # only then is there a final output to collect
            for o in outputs:
                if o.finished and o.metrics is not None:
                    self._finished(rep, o.metrics)
        rep.num_steps += 1
        rep.kv_times.append(self.clock.now)
        rep.kv_usage.append(rep.kv.usage)
        self.num_steps += 1
        if self.max_steps is not None and self.num_steps >= self.max_steps and any(r.has_work for r in self.replicas):
            left = sum(len(r.sched.requests) + len(r.backlog or ()) for r in self.replicas)
            raise RuntimeError(f"simulation hit max_steps={self.max_steps} with {left} requests unfinished")

    def _finished(self, rep: Replica, metrics: RequestMetrics) -> None:
        rep.finished.append(metrics)
        rep.outstanding -= rep.tokens_of.pop(metrics.request_id, 0)
        if self.on_finished is not None:
            self.on_finished(rep, metrics)
