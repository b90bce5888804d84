"""Parallel sampling: one request with ``SamplingParams(n > 1)`` fans out to ``n`` children.

The parent request is what the caller sees (one id, one
:class:`~servelab.pipeline.outputs.GenerationOutput` whose ``completions``
are the ``n`` children's outputs, vLLM's ``RequestOutput.outputs`` shape);
the children are ordinary requests to the scheduler, with ids
``"{parent}#{i}"``.

Decisions:

- **The prompt is prefilled once, and shared through prefix caching**, not
  by forking the parent's block table. Child 0 is queued alone; the other
  ``n - 1`` are held back until child 0's prompt has been computed (its first
  token, or its end, has been delivered). By then the step that wrote the
  prompt's blocks has succeeded, so they are findable by prefix lookup, and
  every other child's prefill is a cache hit on all full prompt blocks (the
  block layer's reference counts share them; only the last, partial block —
  fewer than ``block_size`` tokens — and the last prompt token are computed
  again per child). Forking a block table would save that partial block but
  needs a copy-on-write operation in every KV cache manager and scheduler
  (servelab's, the reference one, vLLM's); prefix caching needs none, works
  with every scheduler and policy, and a preempted child recovers its prompt
  the same way. Without prefix caching (``enable_prefix_caching=False``) all
  ``n`` children are queued at once and each prefills its prompt.
- **Each child has its own seed stream**: child ``i`` samples with
  :func:`child_seed` of the request's seed (child 0 keeps the seed itself,
  so ``n=1`` and completion 0 of ``n>1`` agree); without a request seed each
  child gets the pipeline's per-arrival seed, like any request.
- **Prompt logprobs are computed once**, by child 0 (the others would only
  repeat them and could not use the prefix cache).
- A child that fails fails its completion only; the request ends when every
  completion has ended. The parent's flat fields (``token_ids``, ``text``,
  ``finish_reason``...) mirror completion 0. Aborting the parent aborts every
  child (their blocks are freed) and ends held children with ``"abort"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from servelab.pipeline.delivery import Tracked
from servelab.pipeline.inputs import RenderedPrompt
from servelab.pipeline.outputs import GenerationOutput, StreamEvent
from servelab.samplers import SamplingParams

__all__ = ["ParallelSampling", "child_request_id", "child_seed"]

_GOLDEN = 0x9E3779B97F4A7C15  # odd: i -> seed + i * _GOLDEN is a bijection mod 2**64
_MASK64 = (1 << 64) - 1


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion ``index`` of a request seeded with ``seed`` (None stays None).

    Child 0 keeps ``seed``; the others step through the 64-bit seeds by an odd
    constant, so the ``n`` seeds of one request are distinct.
    """
    if seed is None or index == 0:
        return seed
    return (seed + index * _GOLDEN) & _MASK64


def child_request_id(parent_id: str, index: int) -> str:
    """The scheduler's id of completion ``index`` of request ``parent_id``."""
    return f"{parent_id}#{index}"


@dataclass
class _Family:
    """One parent request and its children."""

    tracked: Tracked  # the parent's (request is None: it is not the scheduler's)
    prompt: Any
    priority: int
    detokenize: bool
    child_ids: list[str]
    held: list[tuple[int, SamplingParams]] = field(default_factory=list)  # children not yet queued
    ended: set[int] = field(default_factory=set)  # completion indexes that have ended
    lora_request: Any = None  # the parent's LoRA adapter, which every child runs with

    @property
    def parent_id(self) -> str:
        return self.tracked.output.request_id

    @property
    def completions(self) -> list[GenerationOutput]:
        completions = self.tracked.output.completions
        assert completions is not None
        return completions


class ParallelSampling:
    """The pipeline's parent/child bookkeeping (one per :class:`~servelab.Pipeline`)."""

    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}
        self._child_of: dict[str, tuple[_Family, int]] = {}

    def add(self, pipe: Any, prompt: Any, params: SamplingParams, *, request_id: str | None, priority: int,
            index: int | None, detokenize: bool, lora_request: Any = None) -> str:
        """Queue a request with ``params.n > 1`` on ``pipe``; returns the parent's id.

        Raises ``ValueError`` (nothing queued) if ``request_id`` or one of its
        children's ids is in use, like ``Pipeline.add_request``.
        """
        if request_id is None:
            number, rid = pipe._new_request_id()
        else:
            rid, number = request_id, next(pipe._counter)
        child_ids = [child_request_id(rid, i) for i in range(params.n)]
        for taken in [rid, *child_ids]:
            if taken in pipe._tracked or taken in pipe.scheduler.requests:
                raise ValueError(f"duplicate request_id {taken!r}: a request with this id is still tracked")
        text = prompt.text if isinstance(prompt, RenderedPrompt) else prompt if isinstance(prompt, str) else None
        position = number if index is None else index
        parent = GenerationOutput(rid, position, text, [],
                                  completions=[GenerationOutput(cid, position, text, []) for cid in child_ids])
        family = _Family(Tracked(parent), prompt, priority, detokenize, child_ids, lora_request=lora_request)
        children = [(i, replace(params, n=1, seed=child_seed(params.seed, i),
                                prompt_logprobs=params.prompt_logprobs if i == 0 else None))
                    for i in range(params.n)]
        pipe._tracked[rid] = family.tracked
        self.families[rid] = family
        for i, cid in enumerate(child_ids):
            self._child_of[cid] = (family, i)
        share_prompt = bool(getattr(pipe.kv_cache_manager, "enable_caching", False))
        family.held = children[1:] if share_prompt else []
        try:
            for i, child_params in (children[:1] if share_prompt else children):
                self._queue_child(pipe, family, i, child_params)
        except BaseException:
            self.abort(pipe, rid)  # interrupted while queueing: end what was queued
            raise
        return rid

    def _queue_child(self, pipe: Any, family: _Family, i: int, params: SamplingParams) -> None:
        cid = family.child_ids[i]
        pipe.add_request(family.prompt, params, request_id=cid, priority=family.priority,
                         index=family.tracked.output.index, detokenize=family.detokenize,
                         lora_request=family.lora_request)
        family.completions[i] = pipe._tracked[cid].output  # updated in place as the child runs

    def _release_held(self, pipe: Any, family: _Family) -> None:
        """Queue the held children now that child 0's prompt is computed (and cached)."""
        held, family.held = family.held, []
        first = family.completions[0]
        if first.finish_reason == "error" and not first.token_ids:  # the prompt itself failed: so would they
            for i, _ in held:
                self._end_unqueued(family, i, "error", first.error)
            return
        for i, params in held:
            self._queue_child(pipe, family, i, params)

    def _end_unqueued(self, family: _Family, i: int, reason: str, error: str | None) -> None:
        out = family.completions[i]
        out.prompt_token_ids = list(family.completions[0].prompt_token_ids)
        out.finish_reason, out.error = reason, error
        family.ended.add(i)

    def regroup(self, pipe: Any, events: Sequence[StreamEvent]) -> list[StreamEvent]:
        """Children's events turned into their parent's (``completion_index`` set); others unchanged."""
        grouped: list[StreamEvent] = []
        for event in events:
            found = self._child_of.get(event.request_id)
            if found is None:
                grouped.append(event)
                continue
            family, i = found
            parent = family.tracked.output
            if event.finished:
                family.ended.add(i)
                del self._child_of[event.request_id]
                pipe._tracked.pop(event.request_id, None)  # its output lives on in parent.completions
            if i == 0:
                self._mirror_first(parent)
                if family.held and (event.new_token_ids or event.finished):
                    self._release_held(pipe, family)
            done = len(family.ended) == len(family.child_ids)
            grouped.append(StreamEvent(parent.request_id, parent.index, event.new_token_ids, event.new_text,
                                       done, event.finish_reason, event.error, completion_index=i))
            if done:
                self._end_family(pipe, family)
        return grouped

    @staticmethod
    def _mirror_first(parent: GenerationOutput) -> None:
        """The parent's flat fields follow completion 0 (its finish fields only at the end)."""
        assert parent.completions is not None
        first = parent.completions[0]
        parent.prompt_token_ids, parent.token_ids, parent.text = first.prompt_token_ids, first.token_ids, first.text
        parent.logprobs, parent.prompt_logprobs, parent.metrics = first.logprobs, first.prompt_logprobs, first.metrics
        parent.structured_unenforced = first.structured_unenforced

    def _end_family(self, pipe: Any, family: _Family) -> None:
        parent = family.tracked.output
        self._mirror_first(parent)
        first = family.completions[0]
        parent.finish_reason, parent.stop_reason, parent.error = first.finish_reason, first.stop_reason, first.error
        parent.structured_violations = first.structured_violations
        family.tracked.done = True
        self.families.pop(parent.request_id, None)
        for cid in family.child_ids:
            self._child_of.pop(cid, None)
            child = pipe._tracked.get(cid)
            if child is not None and child.done:
                del pipe._tracked[cid]

    def abort(self, pipe: Any, parent_id: str) -> bool:
        """End every child of ``parent_id`` now (``"abort"``); False if it has ended already."""
        family = self.families.get(parent_id)
        if family is None:
            return False
        interrupted: BaseException | None = None
        for i, _ in family.held:
            self._end_unqueued(family, i, "abort", None)
        family.held = []
        for i, cid in enumerate(family.child_ids):
            if i not in family.ended:
                try:
                    pipe.abort_request(cid)
                except BaseException as exc:  # ended all the same (abort_request's guarantee)
                    interrupted = interrupted or exc
        # the children's final events become the parent's, in place, so a run that filters by id sees them
        ours = set(family.child_ids)
        pipe._events = [e for e in pipe._events if e.request_id not in ours] + \
            self.regroup(pipe, [e for e in pipe._events if e.request_id in ours])
        if not family.tracked.done:  # every child had ended without an event left to carry the end
            family.ended.update(range(len(family.child_ids)))
            self._end_family(pipe, family)
            parent = family.tracked.output
            pipe._events.append(StreamEvent(parent_id, parent.index, [], "", True, parent.finish_reason,
                                            parent.error))
        if interrupted is not None:
            raise interrupted
        return True
