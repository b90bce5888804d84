"""``Pipeline``: the components glued into a serving engine you can take apart.

One step is ``schedule() -> ModelRunner.execute() -> update_from_output()``,
then each request's new tokens go through its incremental detokenizer (stop
strings). Every setting lives in one :class:`~servelab.config.PipelineConfig`
(keyword arguments fill it); components can also be passed as objects:

>>> pipe = Pipeline.from_pretrained(path, drafter="ngram", num_speculative_tokens=3, verifier="typical")
>>> outs = pipe.generate(["The cache", "On a quiet morning"], SamplingParams(temperature=0, max_tokens=32))
>>> print(outs[0].text, outs[0].finish_reason, outs[0].metrics.ttft)
>>> print(pipe.last_run_metrics.table())

Three levels of use: ``generate`` / ``chat`` (a batch, outputs in prompt
order), ``stream`` (an iterator of :class:`StreamEvent`), and ``add_request``
/ ``step`` / ``abort_request`` (drive the loop yourself; ``run_metrics()``
reads the metrics so far).

**Requests end exactly once, and one request's failure touches no other.**
Bad input (empty prompt, prompt over ``max_model_len``, token ids outside the
vocabulary, sampling params that do not fit the model:
``SamplingParams.validate_for_model``) fails *that* request when it is added,
with ``finish_reason="error"`` and a message. User code that raises at
sampling time (a logits processor, the sampler, the verifier, the drafter)
fails the requests it was called for (see :class:`ModelRunner`); the others
run. A stop string ends the request through the scheduler's
``finish_request(..., FINISHED_STOPPED)`` (not an abort).

**A step is a transaction.** KV blocks become findable by prefix lookup only
after the step that wrote them succeeded (the block layer's rule). If the
model forward raises an ``Exception``, the step is rolled back
(``Scheduler.rollback_step``) and its requests fail with the error; the
engine keeps serving. If it is interrupted (``KeyboardInterrupt``, any
``BaseException``), the step is rolled back — its requests go back to the
waiting queue, the runner forgets their rows — and the interrupt is
re-raised; a ``generate`` or ``stream`` call being interrupted then aborts
what it started, so the next call's output equals a fresh pipeline's. When a
call returns, or a stream is closed early, every request it added has ended
and released its KV blocks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from servelab.config import PipelineConfig
from servelab.executor.driver import create_executor
from servelab.models import load_model, load_tokenizer
from servelab.models.gguf import shared_gguf_reader
from servelab.pipeline.batch import BatchRuns
from servelab.pipeline.construction import PipelineConstruction
from servelab.pipeline.delivery import OutputDelivery, Tracked, warn_unenforced
from servelab.pipeline.detokenizer import IncrementalDetokenizer
from servelab.pipeline.inputs import RenderedPrompt, prompt_token_ids, request_params
from servelab.pipeline.metrics import MetricsRecorder, RunMetrics
from servelab.pipeline.outputs import GenerationOutput, StreamEvent
from servelab.pipeline.parallel_sampling import ParallelSampling
from servelab.lora.binding import bind_lora, request_lora_name
from servelab.pipeline.setup import resolve_quantization, prepare_model, scheduler_kv_cache_manager
from servelab.pipeline.sizing import peak_rss_bytes
from servelab.blocks.interfaces import KVCacheManagerProtocol
from servelab.samplers import SamplerProtocol, SamplingParams
from servelab.scheduling import Request, RequestMetrics, SchedulerInterface
from servelab.scheduling.schedulers import DEFAULT_SCHEDULER

_CACHE_SETTINGS = ("block_size", "num_blocks", "enable_prefix_caching", "kv_cache_memory_bytes", "eviction_policy",
                   "kv_cache_groups")


class Pipeline(PipelineConstruction, BatchRuns, OutputDelivery):
    """A serving engine over one model (see the module docstring).

    Args:
        model: a :class:`servelab.models.LlamaForCausalLM`.
        tokenizer: a Hugging Face tokenizer, or None (then prompts must be token
            ids, outputs have no text, stop strings and ``chat`` are refused).
        config: a :class:`~servelab.config.PipelineConfig` (default: all defaults).
        kv_cache_manager: a ready KV cache manager (a
            :class:`~servelab.blocks.KVCacheManager`, the reference one, or
            your own with the same interface); its block size and pool size
            are used, so the cache settings must not be given with it.
        sampler: a ``Sampler`` (default ``Sampler()``), or any
            :class:`~servelab.samplers.SamplerProtocol`.
        scheduler: a registered scheduler name (``"servelab"``, the default;
            ``"vllm"``: vLLM's real v1 scheduler, needs vLLM; see
            :func:`servelab.scheduling.register_scheduler`), a factory called
            like the registered ones (a ``Scheduler`` subclass), or a ready
            :class:`~servelab.scheduling.SchedulerInterface` object (then its
            ``kv_cache_manager`` and ``config`` are the pipeline's).
        kv_connector: None, a registered KV connector name
            (``available_kv_connectors()``: ``"offload"``, ``"pd"``...) or a
            :class:`~servelab.connectors.KVConnector` object (one per
            pipeline): KV from outside the pool (a host/disk tier, another
            pipeline), see :mod:`servelab.connectors`.
        clock: time source for metrics (seconds).
        **settings: flat settings of :class:`PipelineConfig` overriding
            ``config`` (``block_size=8``, ``policy="sjf"``, ``verifier="typical"``...;
            :func:`servelab.config.flat_names` lists them). An unknown name
            raises ``TypeError`` listing the valid ones. ``attention_backend``
            (default ``"auto"``) replaces the model's own.

    Attributes: ``config`` (the resolved config), ``model``, ``tokenizer``,
    ``kv_cache_manager``, ``scheduler``, ``runner``, ``sampler``,
    ``verifier``, ``drafter``, ``attention_backend`` (the backend's name),
    ``max_model_len``, ``block_size``, ``num_blocks``, ``kv_cache_bytes``,
    ``kv_cache_groups`` (the :class:`~servelab.blocks.KVCacheGroup` tuple of a
    :class:`~servelab.blocks.HybridKVCacheManager` — see
    :mod:`servelab.pipeline.hybrid` — else None).
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, config: PipelineConfig | None = None,
                 kv_cache_manager: KVCacheManagerProtocol | None = None, sampler: SamplerProtocol | None = None,
                 scheduler: SchedulerInterface | str | Callable[..., SchedulerInterface] = DEFAULT_SCHEDULER,
                 kv_connector: Any = None,
                 clock: Callable[[], float] = time.perf_counter, **settings: Any) -> None:
        kv_cache_manager = scheduler_kv_cache_manager(scheduler, kv_cache_manager)
        self.config = self._resolve_config(config, settings, kv_cache_manager)
        # refusals of parallel settings come before any process starts (servelab.executor)
        self.executor = create_executor(self.config, model, kv_connector)
        if self.executor.in_process:  # else each worker prepares its own part of the model
            model = prepare_model(model, self.config)
        self._attach_model(model, tokenizer, clock)
        self._build_kv_cache(kv_cache_manager)
        self.kv_connector = self._bind_kv_connector(kv_connector)
        self._build_scheduler(scheduler)
        self._build_runner(sampler)
        self.lora_manager, self._lora = bind_lora(self.config, self.model, self.runner)
        self._tracked: dict[str, Tracked] = {}
        self._parallel = ParallelSampling()  # SamplingParams(n > 1): parents and their children
        self._events: list[StreamEvent] = []
        self._counter = itertools.count()
        self._recorder = self._new_recorder()
        self.last_run_metrics: RunMetrics | None = None
        self.last_outputs: list[GenerationOutput] = []

    @classmethod
    def from_pretrained(cls, path: str | Path, *, config: PipelineConfig | None = None, dtype: Any = None,
                        device: str | torch.device = "cpu", pack_weights: bool = True, **settings: Any) -> Pipeline:
        """Load a checkpoint (a Hugging Face folder or a ``.gguf`` file: model, and
        its tokenizer when it has one) and build a pipeline with ``config`` /
        ``settings`` (the same keyword arguments, and defaults, as the
        constructor; ``kv_cache_manager``, ``sampler``, ``scheduler`` and ``clock`` pass through too).

        A draft checkpoint given as ``drafter`` is loaded with the same dtype,
        device and attention backend. A folder without tokenizer files (normal
        for research checkpoints) gives a pipeline without a tokenizer:
        token-id prompts only.

        ``pack_weights`` is :func:`~servelab.models.load_model`'s: float32 linear
        layers on a CPU run on weights packed once for oneDNN (faster GEMMs, one
        extra copy of each packed weight); False keeps plain ``F.linear``.

        ``quantization`` (a setting like the others) reaches the loader: ``"auto"`` keeps a
        ``.gguf`` file's blocks, None dequantizes it; the resolved per-layer plan
        (:class:`~servelab.quantization.QuantizationPlan`) is what ``pipe.config.quantization`` shows.
        """
        if config is not None and not isinstance(config, PipelineConfig):  # before loading anything
            raise TypeError(f"config must be a servelab.PipelineConfig, got {type(config).__name__}")
        quantization = settings.get("quantization", (config or PipelineConfig()).quantization)
        with shared_gguf_reader():  # a .gguf file is parsed once for the model and its tokenizer
            model, _ = load_model(path, dtype=dtype, device=device, pack_weights=pack_weights,
                                  quantization=quantization)
            tokenizer = load_tokenizer(path)
        plan = getattr(model, "quantization_plan", None)
        if plan is None and quantization not in (None, "none", "auto"):
            plan = resolve_quantization(model, quantization)  # online: resolved against this model's layers
        if plan is not None:
            settings = {**settings, "quantization": plan}
        return cls(model, tokenizer, config=config, **settings)

    def _new_recorder(self) -> MetricsRecorder:
        return MetricsRecorder(self.clock(), speculative=self.num_speculative_tokens > 0)

    # ---- requests in -----------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` a request without its own gets: the checkpoint's
        ``generation_config.json`` sampling defaults (temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens -> max_tokens), as
        vLLM's ``LLM.get_default_sampling_params``; plain ``SamplingParams()``
        where the checkpoint has none. Defaults that are invalid are ignored.
        """
        if self._default_params is None:
            defaults = dict(getattr(self.model_config, "generation_defaults", None) or {})
            try:
                self._default_params = SamplingParams(**defaults)
            except (TypeError, ValueError):
                self._default_params = SamplingParams()
        return self._default_params

    def _params(self, params: Any, number: int) -> SamplingParams:
        if params is None:
            params = self.get_default_sampling_params()
        return request_params(params, number, vocab_size=self.vocab_size, max_logprobs=self.config.max_logprobs,
                              tokenizer=self.tokenizer, eos_token_id=self.eos_token_id,
                              extra_eos=self._extra_eos, seed=self.seed)

    def _new_request_id(self) -> tuple[int, str]:
        """An arrival number and an automatic id no live request uses."""
        while True:
            number = next(self._counter)
            rid = f"req-{number}"
            if rid not in self._tracked and rid not in self.scheduler.requests:
                return number, rid

    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, index: int | None = None,
                    detokenize: bool = True, lora_request: Any = None) -> str:
        """Queue one request; returns its id. Bad input fails the request (its
        final event comes from the next :meth:`step`) instead of raising;
        only a duplicate ``request_id`` raises ``ValueError`` (nothing queued).
        ``lora_request``: a :class:`~servelab.lora.LoRARequest` (needs ``enable_lora``;
        a bad adapter fails the request, naming it).

        ``detokenize=False`` skips streaming detokenization (the text is decoded
        once at the end) unless the request has stop strings. ``SamplingParams(n > 1)``
        fans out to ``n`` children (:mod:`servelab.pipeline.parallel_sampling`)."""
        if isinstance(sampling_params, SamplingParams) and sampling_params.n > 1:
            return self._parallel.add(self, prompt, sampling_params, request_id=request_id, priority=priority,
                                      index=index, detokenize=detokenize, lora_request=lora_request)
        if request_id is None:
            number, rid = self._new_request_id()
        else:
            rid = request_id
            if rid in self._tracked or rid in self.scheduler.requests:
                raise ValueError(f"duplicate request_id {rid!r}: a request with this id is still tracked")
            number = next(self._counter)
        text = prompt.text if isinstance(prompt, RenderedPrompt) else prompt if isinstance(prompt, str) else None
        tracked = Tracked(GenerationOutput(rid, number if index is None else index, text, []))
        self._tracked[rid] = tracked
        try:
            ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size, self.max_model_len)
            tracked.output.prompt_token_ids = ids
            params = self._params(sampling_params, number)
            lora_name = request_lora_name(self._lora, rid, lora_request)  # loads and checks the adapter
            request = Request(rid, ids, params, priority=priority, eos_token_id=self.eos_token_id,
                              lora_name=lora_name)
            if self.tokenizer is not None and (detokenize or params.stop):
                tracked.detok = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop,
                                                       min_tokens=params.min_tokens)
            self._add_to_scheduler(request)
        except (ValueError, TypeError) as exc:
            if self._lora is not None:
                self._lora.release(rid)
            self._fail_unqueued(tracked, priority, f"request {rid!r}: {exc}")
            return rid
        except BaseException:
            if self._lora is not None:
                self._lora.release(rid)
            del self._tracked[rid]  # interrupted before it was queued: leave no trace
            raise
        tracked.request = request
        return rid

    def _add_to_scheduler(self, request: Request) -> None:
        """Compile the request's grammar (if any), then queue it; neither is kept if either fails."""
        grammar = getattr(request.sampling_params, "structured_outputs", None)
        if grammar is not None and not self.executor.supports_structured_outputs:
            raise ValueError(f"structured outputs need the model in the driver's process; the "
                             f"{self.executor.name!r} executor does not apply grammars")
        if grammar is not None:
            unenforced = self.structured.add_request(request.request_id, grammar)
            if grammar.kind == "json":
                self._tracked[request.request_id].output.structured_unenforced = list(unenforced)
                warn_unenforced(request.request_id, unenforced)
        try:
            self.scheduler.add_request(request)
        except BaseException:
            self.structured.remove_request(request.request_id)
            raise

    def _fail_unqueued(self, tracked: Tracked, priority: Any, error: str) -> None:
        now, out = self.clock(), tracked.output
        metrics = RequestMetrics(out.request_id, "default", priority if isinstance(priority, int) else 0, "error",
                                 len(out.prompt_token_ids), 0, 0, 0, 0, 0, now, None, None, now, [])
        self._finish(tracked, "error", metrics, [], "", error=error)

    def abort_request(self, request_id: str) -> bool:
        """End a request now (finish reason "abort"); False if it is not running."""
        if request_id in self._parallel.families:  # a parent of n > 1 children: they all end
            return self._parallel.abort(self, request_id)
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.done or tracked.request is None:
            return False
        interrupted: BaseException | None = None
        try:
            self.scheduler.abort_request(request_id)
        except BaseException as exc:  # the scheduler's end path raised (a policy hook): never leave it running
            interrupted = None if isinstance(exc, Exception) else exc
            if request_id in self.scheduler.requests:
                try:
                    self.scheduler.fail_requests([request_id], f"abort failed: {type(exc).__name__}: {exc}")
                except BaseException as again:  # interrupted in its end path too: ended all the same
                    interrupted = interrupted or (None if isinstance(again, Exception) else again)
        try:
            text = self._flush(tracked)
        except Exception:  # a tokenizer failing here must not keep the request alive
            text = ""
        self._finish(tracked, "abort", tracked.request.metrics(), [], text)
        if interrupted is not None:  # ended; now let the Ctrl-C through
            raise interrupted
        return True

    def has_unfinished_requests(self) -> bool:
        # A final output the scheduler built outside a step (a request it ended while an interrupted
        # schedule() put it back) is still this pipeline's to deliver: kept with the others, for
        # step(). Those of requests already ended here (a generate() that aborted what it started)
        # would be no-ops there, so they are dropped.
        for out in self.scheduler.take_pending_outputs():
            tracked = self._tracked.get(out.request_id)
            if tracked is not None and not tracked.done:
                self._pending.append(out)
        return self.scheduler.has_unfinished_requests() or bool(self._events) or bool(self._pending)

    def get_output(self, request_id: str, *, pop: bool = False) -> GenerationOutput:
        """The output of a request so far (final once it finished); ``pop`` forgets a finished one."""
        tracked = self._tracked[request_id]
        if pop and tracked.done:
            del self._tracked[request_id]
        return tracked.output

    def _kv_transfers_pending(self) -> bool:
        # Only a scheduler with KV-connector states (attach_kv_connector succeeded) has transfers.
        if self.kv_connector is None:
            return False
        return bool(getattr(self.scheduler, "has_pending_kv_transfers")())

    # ---- one step ------------------------------------------------------------------

    def step(self) -> list[StreamEvent]:
        """Run one scheduler step; returns the events of requests that produced
        tokens or ended (plus those that failed or were aborted since the last
        step). See the module docstring for what a failing step does."""
        self._apply_all(self._take_pending())  # outputs an interrupted step could not deliver
        self._apply_all(self.scheduler.take_pending_outputs())  # ends the scheduler has not reported yet
        if not self.scheduler.has_unfinished_requests() and not self._kv_transfers_pending():
            return self._take_events()
        start = self.clock()
        try:
            sched_out = self.scheduler.schedule()
        except BaseException:
            # schedule() itself may have finished (an interrupt in a policy hook
            # or just after): undo whatever plan it left in flight.
            self._rollback(getattr(self.scheduler, "in_flight_output", None))
            raise
        usage = self.kv_cache_manager.usage
        try:
            model_out = self.runner.execute(sched_out)
        except Exception as exc:  # the forward (or the runner) failed: this step's requests fail, nothing else
            self._rollback(sched_out)
            ids = [rid for rid, _, _ in sched_out.iter_scheduled()]
            message = f"the model step failed: {type(exc).__name__}: {exc}"
            self._apply_all(self.scheduler.fail_requests(ids, message))
        except BaseException:
            self._rollback(sched_out)
            raise
        else:
            self._apply_all(self.scheduler.update_from_output(sched_out, model_out))
        if not self.scheduler.has_unfinished_requests():
            self._release_attention_state()
        self._recorder.record_step(usage, sched_out.num_reqs, sched_out.total_num_scheduled_tokens,
                                   self.clock() - start, self.runner.last_verification,
                                   kv_tokens=sched_out.total_num_kv_tokens)
        return self._take_events()

    def _rollback(self, sched_out: Any) -> None:
        """Undo a failed step: the scheduler preempts its requests, the runner forgets their rows."""
        self._release_attention_state()
        if sched_out is None:
            return
        self.scheduler.rollback_step(sched_out)
        self.runner.rollback(sched_out)

    def _release_attention_state(self) -> None:
        """Free what the attention backend carries between forwards (decode K/V) once no
        request needs it; a model without the hook carries nothing."""
        reset = getattr(self.model, "reset_attention_state", None)
        if reset is not None:
            reset()

    # ---- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        """Stop the executor's workers (none for the in-process executor) and free the attention
        state; idempotent. Later steps fail their requests with the reason."""
        self._release_attention_state()
        self.executor.shutdown()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ---- metrics -------------------------------------------------------------------

    def run_metrics(self, reset: bool = False) -> RunMetrics:
        """Metrics of the steps and finished requests since the last reset; ``reset`` starts anew."""
        metrics = self._recorder.finish(self.clock(), peak_rss_bytes=peak_rss_bytes(),
                                        kv_cache_bytes=self.kv_cache_bytes)
        if reset:
            self._recorder = self._new_recorder()
        return metrics
