"""The OpenAI-compatible HTTP server (FastAPI) over an :class:`~servelab.serve.engine.AsyncEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
streaming as server-sent events, with ``stream_options.include_usage``, or
whole), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

Errors are OpenAI error objects: 400 for a bad request (malformed JSON, a
wrong type, a value out of range, a prompt over ``max_model_len``: ``param``
names the field), 404 for an unknown model, 503 when the engine's waiting
queue is full or the engine has stopped. Prompts are tokenized and checked
here, before the engine sees them, so a bad one is a 400 and never takes a
KV block. A client that disconnects aborts its requests (their blocks are
freed before the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from servelab.pipeline.inputs import RenderedPrompt, prompt_token_ids
from servelab.serve.chat import render_conversation
from servelab.serve.engine import AsyncEngine, EngineDeadError, EngineFullError, RequestStream, RequestUpdate
from servelab.serve.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, sampling_params
from servelab.serve.responses import error_body, sse
from servelab.serve.handlers import ChatHandler, CompletionHandler, RequestHandler

__all__ = ["build_app"]


def _error(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind=kind, param=param, code=status), status_code=status)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "json-or-python"}


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """A pydantic / JSON error as a 400 naming the field (``body.messages.0.role`` -> ``messages[0].role``)."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    # pydantic tags the member of a union it tried ("prompt.str", "stop.list[str]"): not a field
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and str(p) not in _TYPE_TAGS and "[" not in str(p)]
    param = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc).lstrip(".") or None
    if first.get("type") == "json_invalid":
        return _error(400, f"the request body is not valid JSON: {first.get('msg')}", param=None)
    return _error(400, f"{param or 'body'}: {first.get('msg')} (got {str(first.get('input'))[:80]!r})", param=param)


def build_app(engine: AsyncEngine, *, model_name: str, chat_template: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as model ``model_name`` (what clients pass as ``model``).

    ``chat_template``: a Jinja template for ``/v1/chat/completions`` when the
    tokenizer has none (or to replace its own).
    """
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown()  # every live request aborted, the step thread joined

    app = FastAPI(title="servelab", docs_url=None, redoc_url=None, lifespan=lifespan)
    created = int(time.time())
    pipe = engine.pipeline

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(ProtocolError)
    async def _on_protocol(request: Request, exc: ProtocolError) -> JSONResponse:
        return _error(exc.status, str(exc), kind=exc.kind, param=exc.param)

    @app.exception_handler(EngineFullError)
    async def _on_full(request: Request, exc: EngineFullError) -> JSONResponse:
        return _error(503, str(exc), kind="service_unavailable")

    @app.exception_handler(EngineDeadError)
    async def _on_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, str(exc), kind="service_unavailable")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "servelab", "max_model_len": pipe.max_model_len}]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ProtocolError(f"The model `{name}` does not exist; this server serves `{model_name}`",
                                param="model", status=404, kind="NotFoundError")

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if body.echo or body.suffix is not None:
            raise ProtocolError("echo and suffix are not supported", param="echo" if body.echo else "suffix")
        prompts = _completion_prompts(body.prompt, pipe)
        params = sampling_params(body, pipe.get_default_sampling_params(), max_tokens=body.max_tokens,
                                 logprobs=body.logprobs)
        return await _serve(CompletionHandler(body, model_name, pipe.tokenizer), engine, prompts, params, body,
                            request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise ProtocolError("top_logprobs needs logprobs=true", param="top_logprobs")
        rendered = render_conversation(pipe.tokenizer, body.messages, chat_template=chat_template,
                                       add_generation_prompt=body.add_generation_prompt,
                                       chat_template_kwargs=body.chat_template_kwargs)
        prompts = [_checked(rendered, pipe, "messages")]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, pipe.get_default_sampling_params(), max_tokens=max_tokens, logprobs=logprobs)
        return await _serve(ChatHandler(body, model_name, pipe.tokenizer), engine, prompts, params, body, request)

    return app


def _checked(prompt: Any, pipe: Any, param: str) -> RenderedPrompt:
    """A prompt tokenized and checked (vocabulary, ``max_model_len``), or :class:`ProtocolError`."""
    try:
        ids = prompt_token_ids(prompt, pipe.tokenizer, pipe.vocab_size, pipe.max_model_len)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(str(exc), param=param) from None
    return RenderedPrompt(prompt.text if isinstance(prompt, RenderedPrompt) else
                          prompt if isinstance(prompt, str) else "", ids)


def _completion_prompts(prompt: Any, pipe: Any) -> list[RenderedPrompt]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [_checked(prompt, pipe, "prompt")]
    if not prompt:
        raise ProtocolError("prompt is empty; valid: a string, token ids, or a non-empty list of either",
                            param="prompt")
    return [_checked(p, pipe, f"prompt[{k}]") for k, p in enumerate(prompt)]


async def _serve(handler: RequestHandler, engine: AsyncEngine, prompts: list[RenderedPrompt], params: Any,
                 body: Any, request: Request) -> Response:
    """Validate against the model, queue every prompt, answer whole or streamed."""
    pipe = engine.pipeline
    try:
        params.validate_for_model(pipe.vocab_size, max_logprobs=pipe.config.max_logprobs,
                                  eos_token_id=pipe.eos_token_id)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(str(exc), param=str(exc).split(" ", 1)[0].removeprefix("SamplingParams.")) from None
    for k, prompt in enumerate(prompts):
        if params.max_tokens is not None and len(prompt.token_ids) + params.max_tokens > pipe.max_model_len:
            raise ProtocolError(f"prompt has {len(prompt.token_ids)} tokens and max_tokens={params.max_tokens}: "
                                f"together over max_model_len={pipe.max_model_len}", param="max_tokens")
    streams: list[RequestStream] = []
    try:
        for k, prompt in enumerate(prompts):
            streams.append(engine.add_request(prompt, params, request_id=f"{handler.response_id}-{k}",
                                              priority=body.priority))
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    handler.prompt_tokens = sum(len(p.token_ids) for p in prompts)
    merged = _merged(streams)
    try:
        first = await merged.__anext__()
    except StopAsyncIteration:  # pragma: no cover - every stream ends with a final update
        first = None
    except BaseException:
        await merged.aclose()
        raise
    if first is not None and _failed_before_tokens(first[1]):
        await merged.aclose()
        raise ProtocolError(first[1].error or "the request failed", param=None)
    if body.stream:
        return StreamingResponse(_stream_body(handler, first, merged), media_type="text/event-stream")
    return await _whole(handler, first, merged, request)


def _failed_before_tokens(update: RequestUpdate) -> bool:
    return update.completion_finish_reason == "error" and not update.new_token_ids


async def _merged(streams: Sequence[RequestStream]) -> AsyncGenerator[tuple[int, RequestUpdate], None]:
    """The updates of several streams as they come, tagged with the prompt index; closing it aborts them all."""
    queue: asyncio.Queue[tuple[int, RequestUpdate | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, stream: RequestStream) -> None:
        try:
            async for update in stream:
                await queue.put((k, update))
        except Exception as exc:
            await queue.put((k, exc))
        finally:
            await queue.put((k, None))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            k, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()


async def _stream_body(handler: RequestHandler, first: Any, merged: AsyncGenerator[tuple[int, RequestUpdate], None]
                       ) -> AsyncIterator[str]:
    try:
        for chunk in handler.start_chunks():
            yield sse(chunk)
        if first is not None:
            for chunk in handler.chunks(*first):
                yield sse(chunk)
        async for k, update in merged:
            for chunk in handler.chunks(k, update):
                yield sse(chunk)
        for chunk in handler.end_chunks():
            yield sse(chunk)
        yield sse("[DONE]")
    except EngineDeadError as exc:
        yield sse(error_body(str(exc), kind="service_unavailable", code=503))
    finally:
        await merged.aclose()  # a disconnected client lands here: its requests are aborted


async def _whole(handler: RequestHandler, first: Any, merged: AsyncGenerator[tuple[int, RequestUpdate], None],
                 request: Request) -> Response:
    async def collect() -> None:
        if first is not None:
            handler.add(*first)
        async for k, update in merged:
            handler.add(k, update)

    task = asyncio.create_task(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await merged.aclose()
    return JSONResponse(handler.whole())
