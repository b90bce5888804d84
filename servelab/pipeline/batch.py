"""The batch APIs of :class:`~servelab.Pipeline`: ``generate``, ``chat`` and ``stream``.

A run queues its whole batch all or nothing, steps until every request of
the batch has ended, and always ends every request it started — even when an
exception or an interrupt arrives, or a stream is closed early (the rest are
aborted; the first interrupt is re-raised once all have ended). Outputs land
in ``last_outputs`` and metrics in ``last_run_metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from servelab._internal.frozen_heap import frozen_heap
from servelab.lora.binding import per_prompt_lora_requests
from servelab.pipeline.inputs import batch_arguments, conversations_of, render_chat
from servelab.pipeline.metrics import ProgressBar
from servelab.pipeline.outputs import GenerationOutput, StreamEvent
from servelab.samplers import SamplingParams

__all__ = ["BatchRuns"]


class BatchRuns:
    """Mixin of :class:`~servelab.Pipeline` (uses its ``add_request``, ``abort_request``,
    ``step``, ``scheduler``, ``tokenizer`` and run bookkeeping)."""

    def _start_run(self, batch: list[tuple[Any, Any, int]], detokenize: bool,
                   loras: Sequence[Any] | None = None) -> list[str]:
        """Queue a batch, all or nothing: if queueing raises, the requests this
        call already queued are aborted and forgotten before the error propagates."""
        self._recorder = self._new_recorder()
        rids: list[str] = []
        try:
            for i, (p, sp, prio) in enumerate(batch):
                rids.append(self.add_request(p, sp, priority=prio, index=i, detokenize=detokenize,
                                             lora_request=loras[i] if loras else None))
        except BaseException:
            self._end_run(rids)
            self.last_outputs = []
            raise
        return rids

    def _end_run(self, rids: list[str]) -> None:
        """Every request of the run ends (anything still running — an exception,
        a stream closed early — is aborted), even if an interrupt arrives
        meanwhile; the first interrupt is re-raised once all have ended."""
        interrupted: BaseException | None = None
        try:
            self._apply_all(self._take_pending())
        except BaseException as exc:
            interrupted = exc
        for rid in rids:
            tracked = self._tracked.get(rid)
            if tracked is not None and not tracked.done:
                try:
                    self.abort_request(rid)
                except BaseException as exc:
                    interrupted = interrupted or exc
        self.last_outputs = [self._tracked.pop(rid).output for rid in rids if rid in self._tracked]
        ours = set(rids)
        self._events = [e for e in self._events if e.request_id not in ours]
        self.last_run_metrics = self.run_metrics()
        if interrupted is not None:
            raise interrupted

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = False, priorities: Sequence[int] | None = None,
                 detokenize: bool = True, lora_request: Any = None) -> list[GenerationOutput]:
        """Run ``prompts`` to completion; one :class:`GenerationOutput` per prompt, in order.

        ``prompts``: one prompt or a list (a prompt is a ``str`` or a list of
        int token ids; ``bytes`` raise ``TypeError``). ``sampling_params``: one
        for all, or one per prompt (default ``SamplingParams()``: temperature
        1, 16 tokens). ``priorities``: one int per prompt (lower first, for the
        "priority" policy). ``lora_request``: a :class:`~servelab.lora.LoRARequest` for
        every prompt, or a list (one per prompt, None for the base model); needs ``enable_lora``.
        Metrics of the run land in :attr:`last_run_metrics`.
        """
        batch = batch_arguments(prompts, sampling_params, priorities)
        loras = per_prompt_lora_requests(lora_request, len(batch))
        progress = ProgressBar(len(batch), use_tqdm)
        try:
            with frozen_heap():  # the run's loop: no full collector passes over the model and imports
                for event in self._stream(batch, detokenize, loras):
                    progress.update(int(event.finished), len(event.new_token_ids))
        finally:
            progress.close()
        return list(self.last_outputs)

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = False, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             priorities: Sequence[int] | None = None) -> list[GenerationOutput]:
        """Generate replies to chat conversations, as vLLM's ``LLM.chat``.

        ``messages``: one conversation (a list of ``{"role": ..., "content":
        ...}`` dicts) or a list of conversations. Each is rendered with the
        tokenizer's chat template (or ``chat_template``), with the assistant
        prompt appended (``add_generation_prompt``), and tokenized without
        adding special tokens, so the template's BOS is the only one. Returns
        one output per conversation (a list even for one); ``prompt`` is the
        rendered text. Raises ``ValueError`` when there is no tokenizer or no
        chat template.
        """
        conversations, _ = conversations_of(messages)
        prompts = [render_chat(self.tokenizer, conv, chat_template=chat_template,
                               add_generation_prompt=add_generation_prompt, chat_template_kwargs=chat_template_kwargs)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priorities=priorities)

    def stream(self, prompts: Sequence[str] | Sequence[Sequence[int]] | str,
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
               priorities: Sequence[int] | None = None, detokenize: bool = True,
               lora_request: Any = None) -> Iterator[StreamEvent]:
        """Like :meth:`generate`, step by step: yields a :class:`StreamEvent` per
        request and step as tokens arrive. Arguments are checked now; requests
        are queued when iteration starts. Closing the iterator early aborts the
        rest. Final outputs land in :attr:`last_outputs`, metrics in
        :attr:`last_run_metrics`. ``lora_request`` as in :meth:`generate`."""
        batch = batch_arguments(prompts, sampling_params, priorities)
        return self._stream(batch, detokenize, per_prompt_lora_requests(lora_request, len(batch)))

    def _stream(self, batch: list[tuple[Any, Any, int]], detokenize: bool,
                loras: Sequence[Any] | None = None) -> Iterator[StreamEvent]:
        rids = self._start_run(batch, detokenize, loras)
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
