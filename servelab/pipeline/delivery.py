"""Delivering the scheduler's outputs to the caller: detokenization, stop
strings, final outputs and events (the output half of :class:`~servelab.Pipeline`).

The scheduler has already applied a step's outputs when they arrive here, so
delivery must not lose them whatever happens: a request whose delivery raises
(a tokenizer failing on its tokens, the stop-string path) fails alone, with
the reason; an interrupt fails that request, keeps the outputs not yet
delivered for the next step (or the end of the run), then propagates. A stop
string ends its request in the scheduler first (``FINISHED_STOPPED``, not an
abort), then in the output.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from servelab.pipeline.detokenizer import IncrementalDetokenizer
from servelab.pipeline.outputs import GenerationOutput, StreamEvent
from servelab.pipeline.prompt_logprobs import render_prompt_logprobs
from servelab.samplers.structured.validation import schema_violations
from servelab.scheduling import Request, RequestMetrics, RequestOutput, RequestStatus

__all__ = ["OutputDelivery", "Tracked", "warn_unenforced"]


def warn_unenforced(request_id: str, unenforced: Sequence[str]) -> None:
    """One warning naming the schema keywords the grammar backend will not enforce for a request."""
    if unenforced:
        warnings.warn(f"request {request_id!r}: the grammar backend does not enforce {len(unenforced)} keyword(s) "
                      f"of its JSON schema, so a finished output may violate them: {'; '.join(unenforced)} "
                      "(StructuredOutputsParams(validate=True) checks each finished output)",
                      UserWarning, stacklevel=4)


@dataclass
class Tracked:
    """What the pipeline keeps per request until its output is taken."""

    output: GenerationOutput
    request: Request | None = None
    detok: IncrementalDetokenizer | None = None
    done: bool = False


class OutputDelivery:
    """Mixin of :class:`~servelab.Pipeline` (uses its ``scheduler``, ``runner``,
    ``structured``, ``tokenizer``, ``_tracked``, ``_events``, ``_pending`` and
    ``_recorder``)."""

    def _apply_all(self, outputs: Sequence[RequestOutput]) -> None:
        """Deliver the scheduler's outputs, each request on its own.

        The scheduler has already applied them, so they must reach the
        caller whatever happens here: a request whose delivery raises
        (detokenizer, stop-string handling) fails alone; on an interrupt
        (``BaseException``) that request fails, the outputs not yet delivered
        are kept for the next :meth:`step` (or the end of the run), and the
        interrupt propagates. The same holds when failing the request is
        itself interrupted (its policy's ``on_request_finished``): the
        scheduler then keeps its final output, and the rest are kept here.
        """
        for k, out in enumerate(outputs):
            try:
                self._apply(out)
            except BaseException as exc:
                try:
                    self._fail_delivery(out, exc)
                except BaseException:
                    # Ending it was interrupted too (a policy hook): the scheduler keeps
                    # its final output for the next step; the others' must not be lost.
                    self._pending = list(outputs[k + 1:]) + self._pending
                    raise
                if not isinstance(exc, Exception):
                    self._pending = list(outputs[k + 1:]) + self._pending
                    raise

    def _take_pending(self) -> list[RequestOutput]:
        pending, self._pending = self._pending, []
        return pending

    def _fail_delivery(self, out: RequestOutput, exc: BaseException) -> None:
        """End a request whose output could not be delivered, with the reason."""
        tracked = self._tracked.get(out.request_id)
        if tracked is None or tracked.done:
            return
        error = f"request {out.request_id!r}: delivering its output failed: {type(exc).__name__}: {exc}"
        if not out.finished and self.scheduler.requests.get(out.request_id) is not None:
            self.scheduler.fail_requests([out.request_id], error)
        metrics = out.metrics or (tracked.request.metrics() if tracked.request is not None else None)
        self._finish(tracked, "error", metrics, [], "", error=error)

    def _take_events(self) -> list[StreamEvent]:
        events, self._events = self._events, []
        if self._parallel.families:  # children's events become their parent's (SamplingParams.n > 1)
            return self._parallel.regroup(self, events)
        return events

    def _flush(self, tracked: Tracked) -> str:
        if tracked.detok is not None:
            return tracked.detok.flush()
        if self.tokenizer is not None:  # detokenize=False: decode once, at the end
            return self.tokenizer.decode(tracked.output.token_ids, skip_special_tokens=True)
        return ""

    def _detokenize(self, tracked: Tracked, out: RequestOutput) -> tuple[list[int], str, str | None]:
        """(new tokens kept, new text, the stop string that matched or None)."""
        new, detok = list(out.new_token_ids), tracked.detok
        if detok is None or not new:
            return new, "", None
        before = detok.num_output_tokens
        delta = detok.update(new)
        if delta.stop_string is not None:
            new = new[: detok.num_output_tokens - before]  # tokens after the stop string are dropped
        return new, delta.text, delta.stop_string

    def _apply(self, out: RequestOutput) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None or tracked.done:
            return  # e.g. the final output of a request ended by a stop string, reported late
        new, text, stop = self._detokenize(tracked, out)  # raising: _apply_all fails this request alone
        result = tracked.output
        if stop is not None and not out.finished:  # ends it now (frees its blocks); not counted as an abort
            self.scheduler.finish_request(out.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop)
        if out.logprobs is not None:
            result.logprobs = (result.logprobs or []) + list(out.logprobs)[: len(new)]
        result.token_ids += new
        self._take_prompt_logprobs(result)
        if stop is not None:
            metrics = out.metrics or tracked.request.metrics()
            n = len(result.token_ids)
            metrics = replace(metrics, finish_reason="stop", num_output_tokens=n, token_times=metrics.token_times[:n])
            self._finish(tracked, "stop", metrics, new, text, stop_reason=stop)
        elif out.finished:
            text += self._flush(tracked)
            self._finish(tracked, out.finish_reason, out.metrics, new, text, stop_reason=out.stop_reason,
                         error=out.error)
        else:
            result.text += text
            self._events.append(StreamEvent(out.request_id, result.index, new, text))

    def _take_prompt_logprobs(self, result: GenerationOutput) -> None:
        """Move a request's prompt logprobs from the runner to its output, once they are complete."""
        pending = self.runner.prompt_logprobs.finished
        if pending and result.request_id in pending:
            result.prompt_logprobs = render_prompt_logprobs(pending.pop(result.request_id), self.tokenizer)

    def _finish(self, tracked: Tracked, reason: str, metrics: RequestMetrics | None, new: list[int], text: str,
                *, stop_reason: Any = None, error: str | None = None) -> None:
        result = tracked.output
        result.text += text
        result.finish_reason, result.stop_reason, result.error, result.metrics = reason, stop_reason, error, metrics
        tracked.done = True
        self._take_prompt_logprobs(result)
        grammar = getattr(getattr(tracked.request, "sampling_params", None), "structured_outputs", None)
        if reason == "stop" and grammar is not None and grammar.validate:
            result.structured_violations = schema_violations(grammar, result.text)
        self.runner.remove_request(result.request_id)  # its row and draft blocks, now rather than next step
        self.structured.remove_request(result.request_id)
        if metrics is not None:
            self._recorder.record_request(metrics, error)
        self._events.append(StreamEvent(result.request_id, result.index, new, text, True, reason, error))
