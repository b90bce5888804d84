"""``Pipeline``: the components glued into a serving engine you can take apart.

One step is ``schedule() -> ModelRunner.execute() -> update_from_output()``,
then each request's new tokens go through its incremental detokenizer (stop
strings). Every component is a constructor argument with a default:

>>> pipe = Pipeline.from_pretrained(path, attention_backend="torch", drafter="ngram", num_speculative_tokens=3)
>>> outs = pipe.generate(["The cache", "On a quiet morning"], SamplingParams(temperature=0, max_tokens=32))
>>> print(outs[0].text, outs[0].finish_reason, outs[0].metrics.ttft)
>>> print(pipe.last_run_metrics.table())

Three levels of use: ``generate`` (a batch, outputs in prompt order),
``stream`` (an iterator of :class:`StreamEvent`), and ``add_request`` /
``step`` / ``abort_request`` (drive the loop yourself; ``run_metrics()`` reads
the metrics so far).

Requests end exactly once. Bad input (empty prompt, prompt over
``max_model_len``, token ids outside the vocabulary, sampling params that do
not fit the model) fails *that* request with ``finish_reason="error"`` and a
message; the others run. A stop string ends the request through the
scheduler's ``abort_request`` (which frees its blocks) and is reported as
``"stop"``. When a call returns, or a stream is closed early, every request
it added has ended and released its KV blocks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from servelab.blocks import KVCacheManager
from servelab.models import allocate_kv_caches, kv_cache_spec, load_model, load_tokenizer
from servelab.pipeline.detokenizer import IncrementalDetokenizer
from servelab.pipeline.drafting import DraftModelDrafter, resolve_drafter
from servelab.pipeline.metrics import MetricsRecorder, ProgressBar, RunMetrics
from servelab.pipeline.outputs import GenerationOutput, StreamEvent
from servelab.pipeline.runner import ModelRunner
from servelab.samplers import Sampler, SamplingParams
from servelab.scheduling import Request, RequestMetrics, RequestOutput, Scheduler, SchedulerConfig

DEFAULT_KV_CACHE_BYTES = 2 << 30
"""KV memory budget when ``num_blocks`` is None and no budget is given (2 GiB)."""
_MASK63 = (1 << 63) - 1


@dataclass
class _Tracked:
    output: GenerationOutput
    request: Request | None = None
    detok: IncrementalDetokenizer | None = None
    done: bool = False


def default_num_blocks(spec: Any, num_layers: int, *, max_model_len: int, max_num_seqs: int,
                       num_speculative_tokens: int = 0, kv_cache_memory_bytes: int | None = None) -> int:
    """Blocks (null block included) for ``max_num_seqs`` requests of ``max_model_len``
    tokens (+ draft lookahead) each, capped by ``kv_cache_memory_bytes`` (default
    :data:`DEFAULT_KV_CACHE_BYTES`) over all layers; at least 2."""
    per_seq = -(-(max_model_len + num_speculative_tokens) // spec.block_size)
    wanted = max_num_seqs * per_seq + 1
    budget = DEFAULT_KV_CACHE_BYTES if kv_cache_memory_bytes is None else int(kv_cache_memory_bytes)
    affordable = budget // (spec.page_size_bytes * num_layers)
    return max(min(wanted, affordable), 2)


class Pipeline:
    """A serving engine over one model (see the module docstring).

    Args:
        model: a :class:`servelab.models.LlamaForCausalLM`.
        tokenizer: a Hugging Face tokenizer, or None (then prompts must be token
            ids, outputs have no text and stop strings are refused).
        attention_backend: None (keep the model's), a backend name ("torch",
            "triton") or an ops object; assigned to ``model.attention``.
        kv_cache_manager: a ready :class:`~servelab.blocks.KVCacheManager`; by
            default one is built from ``block_size``, ``num_blocks`` and
            ``enable_prefix_caching``.
        num_blocks: KV pool size (null block included). None: enough for
            ``max_num_seqs`` requests of ``max_model_len`` tokens, capped by
            ``kv_cache_memory_bytes`` (default 2 GiB); see :func:`default_num_blocks`.
        scheduler_config: a :class:`SchedulerConfig`; by default built from
            ``max_num_seqs``, ``max_num_batched_tokens``,
            ``long_prefill_token_threshold``, ``max_model_len`` and
            ``num_speculative_tokens`` (chunked prefill on).
        policy: scheduling policy name or object ("fcfs", "priority", "sjf", "vtc").
        max_model_len: None: the model's ``max_position_embeddings``.
        sampler: a :class:`Sampler` (default ``Sampler()``).
        drafter: None, "ngram", a draft checkpoint folder, or a ``Drafter``.
        num_speculative_tokens: drafts per request and step (>= 1 with a drafter).
        seed: base seed. A random-sampling request without its own seed gets
            one derived from (``seed``, its arrival number), so a run is
            reproducible from a fresh pipeline; None leaves those to torch's
            global RNG.
        clock: time source for metrics (seconds).
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, attention_backend: Any = None,
                 kv_cache_manager: KVCacheManager | None = None, block_size: int = 16, num_blocks: int | None = None,
                 enable_prefix_caching: bool = True, kv_cache_memory_bytes: int | None = None,
                 scheduler_config: SchedulerConfig | None = None, policy: Any = "fcfs", max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, long_prefill_token_threshold: int = 0,
                 max_model_len: int | None = None, sampler: Sampler | None = None, drafter: Any = None,
                 num_speculative_tokens: int = 0, seed: int | None = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not hasattr(model, "compute_logits") or not hasattr(model, "config"):
            raise TypeError(f"model must be a servelab LlamaForCausalLM, got {type(model).__name__}")
        if attention_backend is not None:
            model.attention = attention_backend
        model.check_inputs = False  # prompts are validated here, once, not in every forward
        cfg = model.config
        self.model, self.tokenizer, self.model_config, self.clock = model, tokenizer, cfg, clock
        self.vocab_size: int = cfg.vocab_size
        eos = tuple(cfg.eos_token_ids)
        self.eos_token_id: int | None = eos[0] if eos else None
        self._extra_eos = eos[1:]

        if scheduler_config is not None:
            if num_speculative_tokens and num_speculative_tokens != scheduler_config.num_speculative_tokens:
                raise ValueError(f"num_speculative_tokens={num_speculative_tokens} contradicts scheduler_config."
                                 f"num_speculative_tokens={scheduler_config.num_speculative_tokens}; give one")
            num_speculative_tokens = scheduler_config.num_speculative_tokens
            max_model_len = scheduler_config.max_model_len
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not \
                0 < max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len!r} is invalid; valid: an int in "
                             f"[1, {cfg.max_position_embeddings}] (the model's max_position_embeddings)")
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens={k!r} must be an int >= 0")
        if (drafter is None) != (k == 0):
            raise ValueError(f"drafter={drafter!r} with num_speculative_tokens={k}: speculative decoding needs "
                             "both a drafter ('ngram', a draft-model folder or a Drafter) and "
                             "num_speculative_tokens >= 1, or neither")
        self.max_model_len = max_model_len
        self.num_speculative_tokens = k

        if kv_cache_manager is None:
            spec = kv_cache_spec(model, block_size, model.dtype)
            if num_blocks is None:
                num_blocks = default_num_blocks(spec, cfg.num_hidden_layers, max_model_len=max_model_len,
                                                max_num_seqs=max_num_seqs, num_speculative_tokens=k,
                                                kv_cache_memory_bytes=kv_cache_memory_bytes)
            kv_cache_manager = KVCacheManager(spec, num_blocks, enable_prefix_caching, max_model_len=max_model_len)
        else:
            spec = kv_cache_manager.spec
            want = (cfg.num_key_value_heads, cfg.head_dim)
            if (getattr(spec, "num_kv_heads", None), getattr(spec, "head_size", None)) != want:
                raise ValueError(f"kv_cache_manager.spec {spec!r} does not fit the model: it needs "
                                 f"num_kv_heads={want[0]}, head_size={want[1]}")
            block_size, num_blocks = kv_cache_manager.block_size, kv_cache_manager.block_pool.num_blocks
        self.kv_cache_manager = kv_cache_manager
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, dtype=getattr(spec, "dtype", None))
        self._check_attention()

        if scheduler_config is None:
            scheduler_config = SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, long_prefill_token_threshold=long_prefill_token_threshold,
                num_speculative_tokens=k)
        self.scheduler = Scheduler(scheduler_config, kv_cache_manager, policy, clock=clock)
        self.sampler = sampler if sampler is not None else Sampler()
        self.drafter = resolve_drafter(drafter, dtype=model.dtype, device=model.device,
                                       attention=model.attention, block_size=block_size)
        if isinstance(self.drafter, DraftModelDrafter):
            if self.drafter.vocab_size > self.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({self.drafter.vocab_size}) is larger than the "
                                 f"target's ({self.vocab_size}); they must share the tokenizer")
            if self.drafter.kv_caches is None:
                # As many tokens as the target pool, plus each request's lookahead.
                extra = scheduler_config.max_num_seqs * (-(-k // self.drafter.block_size) + 1)
                self.drafter.allocate(self.drafter.num_blocks or num_blocks + extra)
        self.runner = ModelRunner(model, self.kv_caches, block_size, max_model_len=max_model_len,
                                  sampler=self.sampler, drafter=self.drafter, num_speculative_tokens=k,
                                  max_num_reqs=scheduler_config.max_num_seqs, eos_token_id=self.eos_token_id)
        self.seed = seed
        self._tracked: dict[str, _Tracked] = {}
        self._events: list[StreamEvent] = []
        self._counter = itertools.count()
        self._recorder = MetricsRecorder(clock(), speculative=k > 0)
        self.last_run_metrics: RunMetrics | None = None
        self.last_outputs: list[GenerationOutput] = []

    def _check_attention(self) -> None:
        """Fail now, with the backend's reason, rather than in the first forward."""
        supports = getattr(self.model.attention, "supports", None)
        if supports is None:
            return
        cfg = self.model_config
        key_cache = self.kv_caches.views[0][0]
        query = torch.zeros((1, cfg.num_attention_heads, cfg.head_dim), dtype=key_cache.dtype,
                            device=key_cache.device)
        reason = supports(query, key_cache, sliding_window=cfg.sliding_window)
        if reason is not None:
            name = getattr(self.model.attention, "name", type(self.model.attention).__name__)
            raise ValueError(f"attention backend {name!r} cannot run this model: {reason}")

    @classmethod
    def from_pretrained(cls, path: str | Path, attention_backend: Any = "torch", block_size: int = 16,
                        num_blocks: int | None = None, enable_prefix_caching: bool = True, policy: Any = "fcfs",
                        max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                        long_prefill_token_threshold: int = 0, max_model_len: int | None = None,
                        drafter: Any = None, num_speculative_tokens: int = 0, dtype: Any = None,
                        device: str | torch.device = "cpu", seed: int | None = 0, **kwargs: Any) -> Pipeline:
        """Load a HF checkpoint folder (model + tokenizer) and build a pipeline.

        ``drafter``: None, "ngram", a draft checkpoint folder (same tokenizer;
        loaded with the same dtype, device and attention backend) or a
        ``Drafter``. Other keyword arguments go to the constructor.
        """
        model, _ = load_model(path, dtype=dtype, device=device, attention=attention_backend)
        return cls(model, load_tokenizer(path), block_size=block_size, num_blocks=num_blocks,
                   enable_prefix_caching=enable_prefix_caching, policy=policy, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens,
                   long_prefill_token_threshold=long_prefill_token_threshold, max_model_len=max_model_len,
                   drafter=drafter, num_speculative_tokens=num_speculative_tokens, seed=seed, **kwargs)

    # ---- requests in -----------------------------------------------------------

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is an empty string; at least one token is needed")
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the pipeline has no tokenizer; pass token ids")
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, (torch.Tensor,)) or hasattr(prompt, "tolist"):
            ids = prompt.tolist()
        elif isinstance(prompt, Sequence):
            ids = list(prompt)
        else:
            raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty; at least one token is needed")
        if not set(map(type, ids)) <= {int}:
            bad = next(t for t in ids if type(t) is not int)
            raise TypeError(f"prompt holds {bad!r} ({type(bad).__name__}); token ids must be ints")
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"prompt token id {bad} at position {ids.index(bad)} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, longer than max_model_len={self.max_model_len}")
        return ids

    def _params(self, params: Any, number: int) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate_token_ids(self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r} needs a tokenizer; the pipeline has none")
        if params.bad_words and params.bad_words_token_ids is None:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer; pass bad_words_token_ids instead")
            params = params.resolve_bad_words(lambda s: self.tokenizer.encode(s, add_special_tokens=False))
        extra = tuple(e for e in self._extra_eos if e not in params.stop_token_ids)
        if extra and not params.ignore_eos:  # the scheduler knows one EOS; the rest are stop ids
            params = replace(params, stop_token_ids=params.stop_token_ids + extra)
        if self.seed is not None and params.seed is None and not params.is_greedy:
            params = replace(params, seed=(self.seed * 0x9E3779B97F4A7C15 + number) & _MASK63)
        return params

    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, index: int | None = None,
                    detokenize: bool = True) -> str:
        """Queue one request; returns its id. Bad input fails the request (its
        final event comes from the next :meth:`step`) instead of raising;
        only a duplicate ``request_id`` raises ``ValueError``.

        ``detokenize=False`` skips streaming detokenization (the text is decoded
        once at the end) unless the request has stop strings."""
        number = next(self._counter)
        rid = f"req-{number}" if request_id is None else request_id
        if rid in self._tracked:
            raise ValueError(f"duplicate request_id {rid!r}: a request with this id is still tracked")
        tracked = _Tracked(GenerationOutput(rid, number if index is None else index,
                                            prompt if isinstance(prompt, str) else None, []))
        self._tracked[rid] = tracked
        try:
            ids = self._prompt_ids(prompt)
            tracked.output.prompt_token_ids = ids
            params = self._params(sampling_params, number)
            request = Request(rid, ids, params, priority=priority, eos_token_id=self.eos_token_id)
            if self.tokenizer is not None and (detokenize or params.stop):
                tracked.detok = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop,
                                                       min_tokens=params.min_tokens)
            self.scheduler.add_request(request)
        except (ValueError, TypeError) as exc:
            now = self.clock()
            metrics = RequestMetrics(rid, "default", priority if isinstance(priority, int) else 0, "error",
                                     len(tracked.output.prompt_token_ids), 0, 0, 0, 0, 0, now, None, None, now, [])
            self._finish(tracked, "error", metrics, [], "", error=f"request {rid!r}: {exc}")
            return rid
        tracked.request = request
        return rid

    def abort_request(self, request_id: str) -> bool:
        """End a request now (finish reason "abort"); False if it is not running."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.done or tracked.request is None:
            return False
        self.scheduler.abort_request(request_id)
        self._finish(tracked, "abort", tracked.request.metrics(), [], self._flush(tracked))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._events)

    def get_output(self, request_id: str, *, pop: bool = False) -> GenerationOutput:
        """The output of a request so far (final once it finished); ``pop`` forgets a finished one."""
        tracked = self._tracked[request_id]
        if pop and tracked.done:
            del self._tracked[request_id]
        return tracked.output

    # ---- one step ------------------------------------------------------------------

    def step(self) -> list[StreamEvent]:
        """Run one scheduler step; returns the events of requests that produced
        tokens or ended (plus those that failed or were aborted since the last step)."""
        events, self._events = self._events, []
        if not self.scheduler.has_unfinished_requests():
            return events
        start = self.clock()
        sched_out = self.scheduler.schedule()
        usage = self.kv_cache_manager.usage
        model_out = self.runner.execute(sched_out)
        for out in self.scheduler.update_from_output(sched_out, model_out):
            self._apply(out)
        events += self._events
        self._events = []
        self._recorder.record_step(usage, sched_out.num_reqs, sched_out.total_num_scheduled_tokens,
                                   self.clock() - start, self.runner.last_verification,
                                   kv_tokens=sched_out.total_num_kv_tokens)
        return events

    def _flush(self, tracked: _Tracked) -> str:
        if tracked.detok is not None:
            return tracked.detok.flush()
        if self.tokenizer is not None:  # detokenize=False: decode once, at the end
            return self.tokenizer.decode(tracked.output.token_ids, skip_special_tokens=True)
        return ""

    def _apply(self, out: RequestOutput) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None or tracked.done:
            return  # e.g. the abort that ended a stop-string request, reported late
        new, text, stop = list(out.new_token_ids), "", None
        detok = tracked.detok
        if detok is not None and new:
            before = detok.num_output_tokens
            delta = detok.update(new)
            text, stop = delta.text, delta.stop_string
            if stop is not None:
                new = new[: detok.num_output_tokens - before]  # tokens after the stop string are dropped
        result = tracked.output
        if out.logprobs is not None:
            result.logprobs = (result.logprobs or []) + list(out.logprobs)[: len(new)]
        if stop is not None:
            if not out.finished:
                self.scheduler.abort_request(out.request_id)  # frees its blocks now
            result.token_ids += new
            metrics = (out.metrics or tracked.request.metrics())
            n = len(result.token_ids)
            metrics = replace(metrics, finish_reason="stop", num_output_tokens=n, token_times=metrics.token_times[:n])
            self._finish(tracked, "stop", metrics, new, text, stop_reason=stop)
        elif out.finished:
            result.token_ids += new
            text += self._flush(tracked)
            self._finish(tracked, out.finish_reason, out.metrics, new, text, stop_reason=out.stop_reason,
                         error=out.error)
        else:
            result.token_ids += new
            result.text += text
            self._events.append(StreamEvent(out.request_id, result.index, new, text))

    def _finish(self, tracked: _Tracked, reason: str, metrics: RequestMetrics | None, new: list[int], text: str,
                *, stop_reason: Any = None, error: str | None = None) -> None:
        result = tracked.output
        result.text += text
        result.finish_reason, result.stop_reason, result.error, result.metrics = reason, stop_reason, error, metrics
        tracked.done = True
        self.runner.remove_request(result.request_id)  # its row and draft blocks, now rather than next step
        if metrics is not None:
            self._recorder.record_request(metrics)
        self._events.append(StreamEvent(result.request_id, result.index, new, text, True, reason, error))

    # ---- metrics -------------------------------------------------------------------

    def run_metrics(self, reset: bool = False) -> RunMetrics:
        """Metrics of the steps and finished requests since the last reset; ``reset`` starts anew."""
        now = self.clock()
        metrics = self._recorder.finish(now)
        if reset:
            self._recorder = MetricsRecorder(now, speculative=self.num_speculative_tokens > 0)
        return metrics

    # ---- batch APIs --------------------------------------------------------------------

    @staticmethod
    def _batch(prompts: Any, sampling_params: Any, priorities: Any) -> list[tuple[Any, Any, int]]:
        """Check a batch call's arguments; ``(prompt, params, priority)`` per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and all(type(t) is int for t in prompts)):
            prompts = [prompts]  # one prompt (text, or token ids)
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}")
        num = len(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * num
        elif isinstance(sampling_params, Sequence) and len(sampling_params) == num:
            params = list(sampling_params)
        else:
            raise ValueError(f"sampling_params must be one SamplingParams or a list of {num} (one per prompt)")
        if priorities is None:
            priorities = [0] * num
        elif not isinstance(priorities, Sequence) or len(priorities) != num:
            raise ValueError(f"priorities must be None or a list of {num} ints (one per prompt)")
        return list(zip(prompts, params, priorities))

    def _start_run(self, batch: list[tuple[Any, Any, int]], detokenize: bool) -> list[str]:
        self._recorder = MetricsRecorder(self.clock(), speculative=self.num_speculative_tokens > 0)
        return [self.add_request(p, sp, priority=prio, index=i, detokenize=detokenize)
                for i, (p, sp, prio) in enumerate(batch)]

    def _end_run(self, rids: list[str]) -> None:
        for rid in rids:  # anything still running (an exception, a stream closed early) is aborted
            tracked = self._tracked.get(rid)
            if tracked is not None and not tracked.done:
                self.abort_request(rid)
        self.last_outputs = [self._tracked.pop(rid).output for rid in rids if rid in self._tracked]
        ours = set(rids)
        self._events = [e for e in self._events if e.request_id not in ours]
        self.last_run_metrics = self.run_metrics()

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = False, priorities: Sequence[int] | None = None,
                 detokenize: bool = True) -> list[GenerationOutput]:
        """Run ``prompts`` to completion; one :class:`GenerationOutput` per prompt, in order.

        ``sampling_params``: one for all, or one per prompt (default
        ``SamplingParams()``: temperature 1, 16 tokens). ``priorities``: one int
        per prompt (lower first, for the "priority" policy). Metrics of the
        run land in :attr:`last_run_metrics`.
        """
        rids = self._start_run(self._batch(prompts, sampling_params, priorities), detokenize)
        pending = set(rids)
        progress = ProgressBar(len(rids), use_tqdm)
        try:
            while pending:
                events = self.step()
                done = [e for e in events if e.finished and e.request_id in pending]
                pending.difference_update(e.request_id for e in done)
                progress.update(len(done), sum(len(e.new_token_ids) for e in events))
                if pending and not events and not self.scheduler.has_unfinished_requests():
                    raise RuntimeError(f"requests {sorted(pending)[:5]} were lost: not finished, not scheduled")
        finally:
            progress.close()
            self._end_run(rids)
        return list(self.last_outputs)

    def stream(self, prompts: Sequence[str] | Sequence[Sequence[int]] | str,
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
               priorities: Sequence[int] | None = None, detokenize: bool = True) -> Iterator[StreamEvent]:
        """Like :meth:`generate`, step by step: yields a :class:`StreamEvent` per
        request and step as tokens arrive. Arguments are checked now; requests
        are queued when iteration starts. Closing the iterator early aborts the
        rest. Final outputs land in :attr:`last_outputs`, metrics in
        :attr:`last_run_metrics`."""
        return self._stream(self._batch(prompts, sampling_params, priorities), detokenize)

    def _stream(self, batch: list[tuple[Any, Any, int]], detokenize: bool) -> Iterator[StreamEvent]:
        rids = self._start_run(batch, detokenize)
        pending = set(rids)
        try:
            while pending:
                events = self.step()
                for event in events:
                    if event.request_id in pending:
                        if event.finished:
                            pending.discard(event.request_id)
                        yield event
                if pending and not events and not self.scheduler.has_unfinished_requests():
                    raise RuntimeError(f"requests {sorted(pending)[:5]} were lost: not finished, not scheduled")
        finally:
            self._end_run(rids)
