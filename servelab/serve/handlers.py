"""Per-request response builders: updates from the engine in, OpenAI bodies or stream chunks out.

One handler per HTTP request. ``add`` accumulates a whole response;
``chunks`` turns one update into stream chunks (chat sends the assistant
role first for each choice, then content deltas, the finish reason on the
choice's last chunk); ``end_chunks`` adds the usage chunk when
``stream_options.include_usage`` is set.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from servelab.serve.engine import RequestUpdate
from servelab.serve.responses import chat_logprobs, completion_logprobs, envelope, usage

__all__ = ["ChatHandler", "CompletionHandler", "RequestHandler"]


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    text_length: int = 0


class RequestHandler:
    """What both endpoints share: choice bookkeeping, usage, ids."""

    prefix = "cmpl"
    object_whole = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, body: Any, model: str, tokenizer: Any) -> None:
        self.body, self.model, self.tokenizer = body, model, tokenizer
        self.response_id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.prompt_tokens = 0
        self.choices: dict[int, _Choice] = {}

    def choice_index(self, k: int, update: RequestUpdate) -> int:
        return k * self.body.n + update.completion_index

    def _choice(self, index: int) -> _Choice:
        return self.choices.setdefault(index, _Choice())

    def _record(self, k: int, update: RequestUpdate) -> tuple[int, _Choice]:
        index = self.choice_index(k, update)
        choice = self._choice(index)
        choice.text.append(update.new_text)
        choice.num_tokens += len(update.new_token_ids)
        if update.new_logprobs is not None:
            choice.logprobs.extend(update.new_logprobs)
        if update.completion_finish_reason is not None:
            choice.finish_reason = update.completion_finish_reason
        return index, choice

    def add(self, k: int, update: RequestUpdate) -> None:
        self._record(k, update)

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, sum(c.num_tokens for c in self.choices.values()))

    def _envelope(self, kind: str) -> dict[str, Any]:
        return envelope(self.response_id, kind, self.model)

    def start_chunks(self) -> list[dict[str, Any]]:
        return []

    def end_chunks(self) -> list[dict[str, Any]]:
        options = self.body.stream_options
        if options is not None and options.include_usage:
            return [{**self._envelope(self.object_chunk), "choices": [], "usage": self.usage()}]
        return []

    def chunks(self, k: int, update: RequestUpdate) -> list[dict[str, Any]]:
        raise NotImplementedError

    def whole(self) -> dict[str, Any]:
        raise NotImplementedError


class CompletionHandler(RequestHandler):
    """``/v1/completions``."""

    def _logprobs(self, entries: list[Any], offset: int) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        return completion_logprobs(self.tokenizer, entries, offset)

    def chunks(self, k: int, update: RequestUpdate) -> list[dict[str, Any]]:
        index, choice = self._record(k, update)
        offset = choice.text_length
        choice.text_length += len(update.new_text)
        if not update.new_text and not update.new_token_ids and update.completion_finish_reason is None:
            return []
        return [{**self._envelope(self.object_chunk),
                 "choices": [{"index": index, "text": update.new_text,
                              "logprobs": self._logprobs(update.new_logprobs or [], offset),
                              "finish_reason": update.completion_finish_reason}]}]

    def whole(self) -> dict[str, Any]:
        choices = [{"index": i, "text": "".join(c.text), "logprobs": self._logprobs(c.logprobs, 0),
                    "finish_reason": c.finish_reason} for i, c in sorted(self.choices.items())]
        return {**self._envelope(self.object_whole), "choices": choices, "usage": self.usage()}


class ChatHandler(RequestHandler):
    """``/v1/chat/completions``."""

    prefix = "chatcmpl"
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def _logprobs(self, entries: list[Any]) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.tokenizer, entries, self.body.top_logprobs or 0)

    def start_chunks(self) -> list[dict[str, Any]]:
        return [{**self._envelope(self.object_chunk),
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]} for i in range(self.body.n)]

    def chunks(self, k: int, update: RequestUpdate) -> list[dict[str, Any]]:
        index, _ = self._record(k, update)
        out = []
        wanted = update.new_text or update.completion_finish_reason is not None or \
            (self.body.logprobs and update.new_token_ids)
        if wanted:
            delta = {"content": update.new_text} if update.new_text else {}
            out.append({**self._envelope(self.object_chunk),
                        "choices": [{"index": index, "delta": delta,
                                     "logprobs": self._logprobs(update.new_logprobs or []),
                                     "finish_reason": update.completion_finish_reason}]})
        return out

    def whole(self) -> dict[str, Any]:
        choices = [{"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
                    "logprobs": self._logprobs(c.logprobs), "finish_reason": c.finish_reason}
                   for i, c in sorted(self.choices.items())]
        return {**self._envelope(self.object_whole), "choices": choices, "usage": self.usage()}
