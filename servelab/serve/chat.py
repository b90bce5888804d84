"""Chat messages in, one conversation out, rendered to tokens by the chat template.

OpenAI messages come in several shapes: ``content`` a string, a list of
parts (``{"type": "text", "text": ...}``), or None (an assistant turn that
only called tools). :func:`conversation` turns them into the one shape chat
templates read (``{"role", "content": str}``); text parts are joined with a
newline, as vLLM does. Other part types (images, audio) are refused: no
servelab model reads them.

A tokenizer without a chat template (research checkpoints, the tiny test
model) falls back to :data:`CHATML_TEMPLATE` when the server is started
with it (``servelab serve --chat-template chatml``); without one the request
is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from servelab.pipeline.inputs import RenderedPrompt, render_chat
from servelab.serve.protocol import ProtocolError

__all__ = ["CHATML_TEMPLATE", "ROLES", "conversation", "render_conversation"]

ROLES = ("system", "developer", "user", "assistant", "tool")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ProtocolError(f"{where}.content[{k}] has type {kind!r}; valid: 'text' parts with a 'text' "
                                "string (this server reads text only)", param=f"{where}.content[{k}].type")
        texts.append(part["text"])
    return "\n".join(texts)


def conversation(messages: Sequence[Any]) -> list[dict[str, str]]:
    """``[{"role", "content": str}]`` from OpenAI messages (pydantic models or dicts)."""
    out = []
    for k, message in enumerate(messages):
        role = message["role"] if isinstance(message, dict) else message.role
        content = message.get("content") if isinstance(message, dict) else message.content
        if role not in ROLES:
            raise ProtocolError(f"messages[{k}].role={role!r} is invalid; valid: {', '.join(ROLES)}",
                                param=f"messages[{k}].role")
        out.append({"role": role, "content": _content_text(content, f"messages[{k}]")})
    return out


def render_conversation(tokenizer: Any, messages: Sequence[Any], *, chat_template: str | None = None,
                        add_generation_prompt: bool = True,
                        chat_template_kwargs: dict[str, Any] | None = None) -> RenderedPrompt:
    """The prompt (text and ids) of a chat request; :class:`ProtocolError` when it cannot be rendered."""
    conv: list[Any] = conversation(messages)
    try:
        return render_chat(tokenizer, conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                           chat_template_kwargs=chat_template_kwargs)
    except Exception as exc:  # a template error (jinja raises its own types) is the request's problem
        raise ProtocolError(f"the chat template could not render these messages: {type(exc).__name__}: {exc}",
                            param="messages") from None
