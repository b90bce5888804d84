"""vLLM's real v1 scheduler inside a servelab :class:`~servelab.Pipeline`.

``Pipeline(model, tok, scheduler="vllm")`` (or ``Pipeline.from_pretrained(path,
scheduler="vllm")``) runs vLLM's ``vllm.v1.core.sched.scheduler.Scheduler``
— its admission, chunked prefill, prefix caching (vLLM's own KV cache manager
and block pool) and preemption — behind servelab's
:class:`~servelab.scheduling.interfaces.SchedulerInterface`, so the same
model runner, sampler and metrics serve both schedulers and whole schedulers
can be compared, not only policies.

How it maps (one step): servelab ``Request`` -> a vLLM ``Request`` with the
same id, prompt, priority and arrival time; vLLM's ``SchedulerOutput`` ->
servelab's (block ids pass through in vLLM's per-group shape, a tuple with one
list per KV-cache group, which is servelab's too; a resumed request carries
its tokens; a request vLLM resumes that the runner never saw as started is
sent as new); the runner's ``ModelRunnerOutput`` -> vLLM's, then vLLM's
``update_from_output``. vLLM's block ids index the pipeline's KV tensors
directly: vLLM's pool has exactly the pipeline's ``num_blocks`` (block 0
is the null block in both).

**Stops are servelab's.** vLLM is given no EOS and no stop tokens (only
``max_tokens``); every sampled token goes through servelab's stop rule (EOS
unless ``ignore_eos``, ``stop_token_ids``, ``min_tokens``, ``max_tokens``,
``max_model_len``), and a request servelab ends is finished in vLLM with
``finish_requests``. So both schedulers end a request on the same token.

Policy: ``"fcfs"`` and ``"priority"`` are vLLM's own; any other servelab
policy (name or object) runs inside vLLM through
:func:`~servelab.integrations.vllm.make_scheduler_cls`.

Differences from servelab's scheduler (vLLM's semantics, kept): a waiting
request is admitted only when its whole prompt fits
(``scheduler_reserve_full_isl``); blocks become findable by prefix lookup when
they are allocated, not after the step computed them — so after a failed
step (``rollback_step``) the blocks that step would have written are taken
out of vLLM's prefix index here; a request that can never fit waits
forever in vLLM — here it fails (finish reason ``"error"``) once nothing else
runs, as in servelab. Refused: speculative decoding
(``num_speculative_tokens > 0``) and KV managers of several groups.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from servelab.integrations.vllm._compat import require_vllm

require_vllm()

from vllm.sampling_params import SamplingParams as VllmSamplingParams  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput as VllmModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request as VllmRequest  # noqa: E402
from vllm.v1.request import RequestStatus as VllmStatus  # noqa: E402

from servelab.blocks.interfaces import KVCacheManagerProtocol  # noqa: E402
from servelab.integrations.vllm.harness import _hasher, build_scheduler  # noqa: E402
from servelab.integrations.vllm.scheduler import make_scheduler_cls  # noqa: E402
from servelab.scheduling.config import SchedulerConfig  # noqa: E402
from servelab.scheduling.interfaces import SchedulingPolicy  # noqa: E402
from servelab.scheduling.output import (  # noqa: E402
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
)
from servelab.scheduling.request import Request, RequestStatus  # noqa: E402

__all__ = ["VllmPipelineScheduler"]

_TO_VLLM = {
    RequestStatus.FINISHED_STOPPED: VllmStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED: VllmStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED: VllmStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_FAILED: VllmStatus.FINISHED_ERROR,
}
_NATIVE = ("fcfs", "priority")


def _per_group(block_ids: Sequence[Sequence[int]]) -> tuple[list[int], ...]:
    """vLLM's per-group block ids (one list per KV-cache group), as fresh lists."""
    return tuple([*ids] for ids in block_ids)


class _VllmKVView:
    """The pipeline's KV cache manager as seen through vLLM's pool: ``usage`` and
    ``num_free_blocks`` are vLLM's (the scheduler that allocates), the rest is the
    servelab manager's (spec, block size, pool size)."""

    def __init__(self, manager: KVCacheManagerProtocol, vllm_scheduler: Any) -> None:
        self._manager = manager
        self._vllm = vllm_scheduler

    @property
    def usage(self) -> float:
        return float(self._vllm.kv_cache_manager.usage)

    @property
    def num_free_blocks(self) -> int:
        return int(self._vllm.kv_cache_manager.block_pool.get_num_free_blocks())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


class VllmPipelineScheduler:
    """vLLM's v1 scheduler as a servelab :class:`SchedulerInterface` (see the module docstring).

    Args (the registry's factory signature, as :class:`~servelab.scheduling.Scheduler`):
        config: servelab's limits (``max_num_seqs``, ``max_num_batched_tokens``,
            ``max_model_len``, ``long_prefill_token_threshold``).
        kv_cache_manager: the pipeline's manager: its ``block_size``,
            ``num_blocks`` and ``enable_caching`` size vLLM's own.
        policy: ``"fcfs"`` / ``"priority"`` (vLLM's) or any servelab policy (bridged).
        clock: timestamps of servelab's request metrics.

    Attributes: ``vllm`` (vLLM's scheduler), ``requests`` (servelab requests by id),
    ``kv_cache_manager`` (the pipeline's manager, with vLLM's usage).
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManagerProtocol,
                 policy: SchedulingPolicy | str = "fcfs", *, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        if config.num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens}: the vLLM scheduler in the "
                             "pipeline runs without speculative decoding; use scheduler='servelab' for it")
        if getattr(kv_cache_manager, "groups", None) is not None:
            raise ValueError("the vLLM scheduler in the pipeline takes one KV-cache group; this model has "
                             "several (kv_cache_groups='uniform' keeps one)")
        native = isinstance(policy, str) and policy in _NATIVE
        self.config = config
        self.clock = clock
        self.block_size: int = kv_cache_manager.block_size
        self.enable_caching = bool(kv_cache_manager.enable_caching)
        self.vllm = build_scheduler(
            None if native else make_scheduler_cls(policy), num_blocks=kv_cache_manager.num_blocks,
            block_size=self.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            enable_prefix_caching=self.enable_caching,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=str(policy) if native else "fcfs", reserve_full_prompt=True)
        self.kv_cache_manager = _VllmKVView(kv_cache_manager, self.vllm)
        self.requests: dict[str, Request] = {}
        self._delivered: set[str] = set()  # requests the runner was sent as new (and not rolled back as new)
        self._pending: list[RequestOutput] = []
        self._order = itertools.count()
        self.num_steps = self.num_preemptions = self.num_finished = self.num_failed = self.num_aborted = 0
        self.in_flight_output: SchedulerOutput | None = None
        self._in_flight: tuple[SchedulerOutput, Any] | None = None

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request in vLLM (``ValueError`` for a duplicate id or a prompt
        over ``max_model_len``, ``TypeError`` for a non-``Request``)."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a servelab.scheduling.Request, got {type(request).__name__}")
        rid = request.request_id
        if rid in self.requests or rid in self.vllm.requests:
            raise ValueError(f"duplicate request id {rid!r}: a request with this id is still unfinished")
        max_len = self.config.max_model_len
        if request.num_prompt_tokens >= max_len:
            raise ValueError(f"request {rid!r} has a {request.num_prompt_tokens}-token prompt; vLLM needs it "
                             f"shorter than max_model_len={max_len}")
        if request.arrival_time is None:
            request.arrival_time = self.clock()
        request.arrival_order = next(self._order)
        max_tokens = max(1, min(request.max_tokens, max_len - request.num_prompt_tokens))
        params = VllmSamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                    extra_args={"client_id": request.client_id})
        vreq = VllmRequest(rid, list(request.prompt_token_ids), params, None, arrival_time=request.arrival_time,
                           priority=request.priority,
                           block_hasher=_hasher(self.block_size) if self.enable_caching else None)
        self.vllm.add_request(vreq)
        self.requests[rid] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def take_pending_outputs(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        return outputs

    def get_stats(self) -> SchedulerStats:
        v = self.vllm
        return SchedulerStats(len(v.running), len(v.waiting), self.kv_cache_manager.usage, self.num_steps,
                              self.num_preemptions, self.num_finished,
                              self.num_failed, self.num_aborted)

    def abort_request(self, request_id: str) -> bool:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                       stop_reason: int | str | None = None) -> bool:
        """End an unfinished request (abort, stop string); its final output comes from the
        next ``update_from_output``. False if no such request is unfinished."""
        if status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED):
            raise ValueError(f"status={status!r}; valid: FINISHED_ABORTED or FINISHED_STOPPED")
        request = self.requests.get(request_id)
        if request is None:
            return False
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self._pending.append(self._finish(request, status))
        return True

    def fail_requests(self, request_ids: Iterable[str], error: str) -> list[RequestOutput]:
        """End these requests with finish reason "error"; returns their final outputs."""
        if not isinstance(error, str):
            raise TypeError(f"error must be a str (the message), got {type(error).__name__}")
        if isinstance(request_ids, str):
            raise TypeError(f"request_ids must be an iterable of ids, not one str ({request_ids!r})")
        outputs = []
        for rid in dict.fromkeys(request_ids):
            request = self.requests.get(rid)
            if request is not None:
                request.error = error
                outputs.append(self._finish(request, RequestStatus.FINISHED_FAILED))
        return outputs

    def _finish(self, request: Request, status: RequestStatus, new_token_ids: list[int] | None = None,
                vllm_done: bool = False) -> RequestOutput:
        """End ``request`` in both schedulers; returns its final output."""
        rid = request.request_id
        if not vllm_done:
            self.vllm.finish_requests(rid, _TO_VLLM[status])
        del self.requests[rid]
        self._delivered.discard(rid)
        request.status = status
        request.finish_time = self.clock()
        self.num_finished += 1
        self.num_failed += status is RequestStatus.FINISHED_FAILED
        self.num_aborted += status is RequestStatus.FINISHED_ABORTED
        return RequestOutput(rid, new_token_ids or [], True, request.finish_reason, request.stop_reason,
                             request.error, None, request.metrics())

    # ---- one step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """vLLM's ``schedule()``, translated (see the module docstring)."""
        vout = self.vllm.schedule()
        if not vout.total_num_scheduled_tokens:
            self._fail_unfittable()  # nothing admitted although every block is free: it never will be
        now = self.clock()
        self.num_steps += 1
        requests, vreqs = self.requests, self.vllm.requests
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        nst = dict(vout.num_scheduled_tokens)
        for data in vout.scheduled_new_reqs:
            req = requests[data.req_id]
            new_reqs.append(NewRequestData(data.req_id, list(req.prompt_token_ids), req.sampling_params,
                                           _per_group(data.block_ids), data.num_computed_tokens))
            self._delivered.add(data.req_id)
        c = vout.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            req = requests[rid]
            ids = c.new_block_ids[i]  # None: nothing new in any group
            row = _per_group(ids) if ids is not None else ()
            if rid in c.resumed_req_ids and rid not in self._delivered and not req.num_output_tokens:
                new_reqs.append(NewRequestData(rid, list(req.prompt_token_ids), req.sampling_params, row,
                                               c.num_computed_tokens[i]))
                self._delivered.add(rid)
                continue
            resumed = rid in c.resumed_req_ids
            cached.req_ids.append(rid)
            cached.resumed.append(resumed)
            cached.new_block_ids.append(row if (resumed or any(row)) else ())
            cached.num_computed_tokens.append(c.num_computed_tokens[i])
            if resumed:
                cached.resumed_token_ids[rid] = list(req.all_token_ids)
        out = SchedulerOutput(new_reqs, cached, nst, vout.total_num_scheduled_tokens, {},
                              set(vout.finished_req_ids), set(vout.preempted_req_ids or ()), step=self.num_steps)
        for rid, computed, n in out.iter_scheduled():
            out.total_num_kv_tokens += computed + n
            req = requests[rid]
            req.status = RequestStatus.RUNNING
            vreq = vreqs[rid]
            req.num_computed_tokens = vreq.num_computed_tokens
            req.num_preemptions = vreq.num_preemptions
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.num_cached_tokens = computed  # the prefix hit of its first step
        for rid in out.preempted_req_ids:
            if rid in requests and requests[rid].status is RequestStatus.RUNNING:
                requests[rid].status = RequestStatus.PREEMPTED
                self.num_preemptions += 1
        self.in_flight_output = out
        self._in_flight = (out, vout)
        return out

    def _fail_unfittable(self) -> None:
        """Nothing was scheduled, nothing runs, and the head of vLLM's queue was not
        admitted although every block is free: it never will be (vLLM would wait
        forever), so it fails, as in servelab."""
        v = self.vllm
        if v.running or not v.waiting:
            return
        head = v.waiting.peek_request()
        request = self.requests.get(head.request_id)
        if request is None:
            return
        pool = v.kv_cache_manager.block_pool.num_gpu_blocks - 1
        request.error = (f"request {head.request_id!r} cannot fit in the KV cache even alone: it needs room for "
                         f"{head.num_tokens + 1} tokens ({self.block_size}-token blocks) and the cache has {pool} "
                         "usable blocks; add KV blocks or lower max_model_len / max_tokens")
        self._pending.append(self._finish(request, RequestStatus.FINISHED_FAILED))

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_output: ModelRunnerOutput) -> list[RequestOutput]:
        """The runner's results through vLLM's ``update_from_output``; servelab's stop
        rule on every token; one ``RequestOutput`` per request with tokens or an end."""
        vout = self._take_in_flight(scheduler_output)
        outputs, self._pending = self._pending, []
        for rid, message in model_output.errors.items():
            request = self.requests.get(rid)
            if request is not None:
                request.error = message
                outputs.append(self._finish(request, RequestStatus.FINISHED_FAILED))
        given = dict(zip(model_output.req_ids, model_output.sampled_token_ids))
        logprobs = dict(zip(model_output.req_ids, model_output.logprobs)) if model_output.logprobs else {}
        vreqs = self.vllm.requests
        ids = [rid for rid in vout.num_scheduled_tokens if rid in vreqs and not vreqs[rid].is_finished()]
        sampled = []
        for rid in ids:
            toks = [int(t) for t in given.get(rid, ())]
            vreq = vreqs[rid]
            if not toks and vreq.num_computed_tokens >= vreq.num_tokens:
                vreq.num_computed_tokens = vreq.num_tokens - 1  # nothing came back: recompute the last position
            sampled.append(toks)
        vmro = VllmModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                     sampled_token_ids=sampled)
        engine_outputs = self.vllm.update_from_output(vout, vmro)
        now = self.clock()
        for group in engine_outputs.values():
            for o in group.outputs:
                out = self._apply(o, now)
                if out is not None:
                    out.logprobs = logprobs.get(o.request_id)
                    outputs.append(out)
        return outputs

    def _apply(self, o: Any, now: float) -> RequestOutput | None:
        """One vLLM ``EngineCoreOutput`` on its servelab request, with servelab's stop rule."""
        req = self.requests.get(o.request_id)
        if req is None:
            return None
        toks, status = list(o.new_token_ids), None
        num_out = req.num_output_tokens
        for pos, tok in enumerate(toks):
            num_out += 1
            if tok in req.stop_token_ids and num_out >= req.min_tokens:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
            elif num_out >= req.max_tokens or req.num_tokens + pos + 1 >= self.config.max_model_len:
                status = RequestStatus.FINISHED_LENGTH_CAPPED
            else:
                continue
            toks = toks[:pos + 1]
            break
        if toks:
            req.append_output_token_ids(toks, now)
        vreq = self.vllm.requests.get(o.request_id)
        if vreq is not None:
            req.num_computed_tokens = vreq.num_computed_tokens
        if status is None and o.finish_reason is not None:  # vLLM ended it (its length rule)
            status = RequestStatus.FINISHED_LENGTH_CAPPED
        if status is not None:
            return self._finish(req, status, toks, vllm_done=o.finish_reason is not None)
        return RequestOutput(o.request_id, toks) if toks else None

    def _take_in_flight(self, scheduler_output: SchedulerOutput) -> Any:
        if self._in_flight is None or self._in_flight[0] is not scheduler_output:
            raise ValueError("scheduler_output is not the last output of schedule() still in flight")
        vout = self._in_flight[1]
        self._in_flight = self.in_flight_output = None
        return vout

    def rollback_step(self, scheduler_output: SchedulerOutput) -> None:
        """The step failed or was interrupted: its running requests are preempted in vLLM
        (blocks freed, recomputed later), and the blocks it would have written are taken
        out of vLLM's prefix index (vLLM indexes at allocation)."""
        vout = self._take_in_flight(scheduler_output)
        v, now = self.vllm, self.clock()
        computed_before = {rid: c for rid, c, _ in scheduler_output.iter_scheduled()}
        for rid in vout.num_scheduled_tokens:
            vreq = v.requests.get(rid)
            if vreq is None or vreq.status != VllmStatus.RUNNING:
                continue
            self._uncache_unwritten(rid, computed_before.get(rid, 0))
            v.running.remove(vreq)
            v._preempt_request(vreq, now)
            if rid in {d.req_id for d in scheduler_output.scheduled_new_reqs}:
                self._delivered.discard(rid)
            if rid in self.requests:
                self.requests[rid].status = RequestStatus.PREEMPTED
        # vLLM's update_from_output would have cleared these; the next output repeats them
        v.finished_req_ids |= set(vout.finished_req_ids)
        v.reset_preempted_req_ids |= set(vout.preempted_req_ids or ())

    def _uncache_unwritten(self, rid: str, num_written: int) -> None:
        """Drop from vLLM's prefix index the blocks of ``rid`` past its first ``num_written`` tokens."""
        pool = self.vllm.kv_cache_manager.block_pool
        for blocks in self.vllm.kv_cache_manager.get_blocks(rid).blocks:
            for block in blocks[num_written // self.block_size:]:
                pool._maybe_evict_cached_block(block)
