"""The OpenAI wire format: request models (pydantic) and their mapping to :class:`SamplingParams`.

The fields are OpenAI's; servelab's other sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``structured_outputs``, ``priority``) are accepted as
extra body parameters, as vLLM does (``extra_body=`` in the openai SDK).
Unknown fields are ignored (as OpenAI's and vLLM's servers do).

A bad value is refused with :class:`ProtocolError` naming the field as the
client sent it (``param``): the server answers 400 with an OpenAI error object.
``SamplingParams``' own checks do the range checking, so the server's limits
are the library's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servelab.samplers import SamplingParams
from servelab.samplers.structured import StructuredOutputsParams

__all__ = ["ChatCompletionRequest", "CompletionRequest", "ProtocolError", "sampling_params"]


class ProtocolError(ValueError):
    """A request the server refuses: ``status`` (400, 404...), ``param`` (the field), message."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share (OpenAI's, then servelab's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    # servelab / vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = 0


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


_OPENAI_TO_SERVELAB = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                       "repetition_penalty", "min_tokens", "ignore_eos", "n")


def _structured(request: _SamplingFields) -> StructuredOutputsParams | None:
    """``response_format`` (``json_object``, ``json_schema``, ``text``) or ``structured_outputs``."""
    fmt, extra = request.response_format, request.structured_outputs
    if fmt is not None and extra is not None:
        raise ProtocolError("give response_format or structured_outputs, not both", param="response_format")
    try:
        if extra is not None:
            return StructuredOutputsParams(**extra)
        if fmt is None:
            return None
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":  # any JSON object: strict mode would allow only {}
            return StructuredOutputsParams(json={"type": "object"}, strict=False)
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ProtocolError("response_format.json_schema.schema must be a JSON schema object",
                                    param="response_format.json_schema")
            return StructuredOutputsParams(json=spec["schema"], strict=bool(spec.get("strict", True)))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(str(exc), param="structured_outputs" if extra is not None else "response_format") \
            from None
    raise ProtocolError(f"response_format.type={kind!r} is invalid; valid: 'text', 'json_object', 'json_schema'",
                        param="response_format.type")


def sampling_params(request: _SamplingFields, defaults: SamplingParams, *, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """The request's :class:`SamplingParams`: ``defaults`` (the checkpoint's) overridden by what was sent.

    Raises :class:`ProtocolError` naming the field for a value ``SamplingParams`` refuses.
    """
    fields: dict[str, Any] = {name: getattr(defaults, name) for name in
                              ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    for name in _OPENAI_TO_SERVELAB:
        value = getattr(request, name)
        if value is not None:
            fields[name] = value
    fields["max_tokens"] = max_tokens
    fields["logprobs"] = logprobs
    if request.stop is not None:
        fields["stop"] = request.stop
    if request.stop_token_ids is not None:
        fields["stop_token_ids"] = request.stop_token_ids
    if request.logit_bias:
        fields["logit_bias"] = request.logit_bias
    fields["structured_outputs"] = _structured(request)
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        param = message.split(" ", 1)[0].removeprefix("SamplingParams.").split("[")[0].split("=")[0]
        raise ProtocolError(message, param=param if param in fields else None) from None
