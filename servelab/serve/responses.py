"""OpenAI response bodies: completions and chat, whole or as stream chunks, logprobs, usage, errors.

Choice ``index`` is ``prompt_index * n + completion_index`` (OpenAI's order
for a list of prompts with ``n`` completions each). Finish reasons are the
pipeline's (``"stop"``, ``"length"``; ``"abort"`` only when the server
shuts down under a stream).
"""

from __future__ import annotations

import json
import time
from typing import Any

__all__ = ["chat_logprobs", "completion_logprobs", "error_body", "sse", "usage"]


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict[str, Any]:
    """An OpenAI error object (``{"error": {"message", "type", "param", "code"}}``)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event (``data: ...`` and a blank line)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _entries(logprobs: list[Any] | None) -> list[Any]:
    return list(logprobs or [])


def chat_logprobs(tokenizer: Any, logprobs: list[Any] | None, top: int) -> dict[str, Any]:
    """Chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` from the
    pipeline's per-token ``[(sampled id, logprob), (top id, logprob), ...]`` (None: a drafted token)."""
    content: list[dict[str, Any]] = []
    for entry in _entries(logprobs):
        if entry is None:
            content.append({"token": "", "logprob": None, "bytes": [], "top_logprobs": []})
            continue
        (sampled, logprob), alternatives = entry[0], entry[1:1 + top]
        text = _token_text(tokenizer, sampled)
        content.append({"token": text, "logprob": float(logprob), "bytes": list(text.encode()),
                        "top_logprobs": [{"token": (t := _token_text(tokenizer, tid)), "logprob": float(lp),
                                          "bytes": list(t.encode())} for tid, lp in alternatives]})
    return {"content": content}


def completion_logprobs(tokenizer: Any, logprobs: list[Any] | None, offset: int = 0) -> dict[str, Any]:
    """Completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry in _entries(logprobs):
        if entry is None:
            tokens.append("")
            token_logprobs.append(None)
            tops.append(None)
        else:
            tokens.append(_token_text(tokenizer, entry[0][0]))
            token_logprobs.append(float(entry[0][1]))
            tops.append({_token_text(tokenizer, tid): float(lp) for tid, lp in entry[1:]})
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def envelope(response_id: str, kind: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": kind, "created": created if created is not None else int(time.time()),
            "model": model}
