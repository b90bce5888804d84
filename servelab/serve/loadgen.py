"""A small asynchronous OpenAI client for load: streaming requests timed per token, the storm.

Used by the storm test (``tests/serve/test_storm.py``, 60 clients) and the
benchmarks (``bench/serve_peers.py``: 200-client storm, rate sweeps against
``servelab serve`` and ``transformers serve``). It replays what guidellm and
vLLM's ``bench serve`` do for one request: POST a streaming completion, take
the time of the first content chunk (TTFT) and of every later one (ITL), and
count output tokens from the ``usage`` chunk. Needs ``httpx`` (the ``dev`` extra).

The storm (:func:`run_storm`): ``num_clients`` concurrent clients, a third
disconnecting mid-stream, some sending malformed JSON, wrong types, or
prompts over ``max_model_len``; the rest are well-formed greedy streams whose
text is compared with the answer the server gave to the same request alone.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestResult", "StormReport", "run_rate", "run_storm", "stream_request"]


def _httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:
        raise ImportError(f"servelab.serve.loadgen needs httpx: pip install httpx (in servelab's dev extra) "
                          f"({exc})") from exc
    return httpx


@dataclass
class RequestResult:
    """One request as the client saw it (times in seconds from its send)."""

    status: int
    text: str = ""
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    disconnected: bool = False


async def stream_request(client: Any, url: str, payload: dict[str, Any], *, disconnect_after: int | None = None,
                         raw_body: bytes | None = None) -> RequestResult:
    """POST one streaming request (``payload`` as JSON, or ``raw_body`` as is) and read it.

    ``disconnect_after``: close the connection after that many content chunks.
    """
    start = time.perf_counter()
    body = raw_body if raw_body is not None else json.dumps(payload).encode()
    async with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as response:
        result = RequestResult(response.status_code)
        if response.status_code != 200:
            result.error = (await response.aread()).decode(errors="replace")
            result.e2e = time.perf_counter() - start
            return result
        last, chunks = None, 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result.error = json.dumps(event["error"])
                break
            if event.get("usage"):
                result.output_tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter() - start
                    if result.ttft is None:
                        result.ttft = now
                    else:
                        result.itl.append(now - last)  # type: ignore[operator]
                    last = now
                    result.text += piece
                    chunks += 1
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
            if disconnect_after is not None and chunks >= disconnect_after:
                result.disconnected = True
                break
    result.e2e = time.perf_counter() - start
    return result


def _prompt(rng: random.Random, words: int) -> str:
    vocabulary = ("cache", "block", "token", "request", "page", "kernel", "batch", "queue", "prefix", "model")
    return " ".join(rng.choice(vocabulary) for _ in range(words))


@dataclass
class StormReport:
    """What the storm did and what came back."""

    kinds: dict[str, int]
    statuses: dict[str, dict[int, int]]
    wrong_answers: list[str]
    results: dict[str, list[RequestResult]]
    seconds: float


def storm_plan(num_clients: int, seed: int = 0, *, max_model_len: int, max_tokens: int = 12
               ) -> list[tuple[str, dict[str, Any] | None, bytes | None, int | None]]:
    """``(kind, payload, raw body, disconnect_after)`` per client: a third ``disconnect``, a
    tenth each ``malformed`` / ``wrong_type`` / ``too_long``, the rest ``good``."""
    rng = random.Random(seed)
    plan: list[tuple[str, dict[str, Any] | None, bytes | None, int | None]] = []
    for k in range(num_clients):
        stream = {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
                  "max_tokens": max_tokens, "ignore_eos": True}
        if k % 3 == 0:
            plan.append(("disconnect", {"prompt": _prompt(rng, 6), **stream, "max_tokens": 200}, None,
                         1 + k % 4))
        elif k % 10 == 1:
            plan.append(("malformed", None, b'{"prompt": "x", "stream": tru', None))
        elif k % 10 == 2:
            plan.append(("wrong_type", {"prompt": "x", "max_tokens": "ten", "stream": True}, None, None))
        elif k % 10 == 4:
            plan.append(("too_long", {"prompt": "cache " * (max_model_len + 8), **stream}, None, None))
        else:
            plan.append(("good", {"prompt": _prompt(rng, 4 + k % 7), **stream}, None, None))
    return plan


async def run_storm(root: str, num_clients: int, *, max_model_len: int, seed: int = 0, max_tokens: int = 12,
                    timeout_s: float = 600.0) -> StormReport:
    """Run the storm against the server at ``root`` (``http://host:port``); see the module docstring."""
    httpx = _httpx()
    url = root + "/v1/completions"
    plan = storm_plan(num_clients, seed, max_model_len=max_model_len, max_tokens=max_tokens)
    limits = httpx.Limits(max_connections=num_clients + 8, max_keepalive_connections=num_clients + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        good = [payload for kind, payload, _, _ in plan if kind == "good" and payload is not None]
        expected = {}  # the same request served alone, before the storm
        for payload in {json.dumps(p, sort_keys=True): p for p in good}.values():
            expected[json.dumps(payload, sort_keys=True)] = (await stream_request(client, url, payload)).text
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_request(client, url, dict(payload or {}), raw_body=raw,
                                                        disconnect_after=cut) for _, payload, raw, cut in plan))
        seconds = time.perf_counter() - start
    report = StormReport({}, {}, [], {}, seconds)
    for (kind, sent, _, _), result in zip(plan, results):
        report.kinds[kind] = report.kinds.get(kind, 0) + 1
        report.statuses.setdefault(kind, {})
        report.statuses[kind][result.status] = report.statuses[kind].get(result.status, 0) + 1
        report.results.setdefault(kind, []).append(result)
        if kind == "good" and sent is not None and result.text != expected[json.dumps(sent, sort_keys=True)]:
            report.wrong_answers.append(f"{sent['prompt']!r}: {result.text!r}")
    return report


async def run_rate(url: str, payloads: list[dict[str, Any]], rate: float, *, seed: int = 0,
                   timeout_s: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send ``payloads`` as a Poisson process at ``rate`` requests/s (inf: all at once);
    returns the results and the wall time from the first send to the last answer."""
    httpx = _httpx()
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(payloads) + 8, max_keepalive_connections=len(payloads) + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(delay: float, payload: dict[str, Any]) -> RequestResult:
            await asyncio.sleep(delay)
            return await stream_request(client, url, payload)

        delays, t = [], 0.0
        for _ in payloads:
            delays.append(t)
            t += 0.0 if rate == float("inf") else rng.expovariate(rate)
        results = await asyncio.gather(*(one(d, p) for d, p in zip(delays, payloads)))
        return list(results), time.perf_counter() - start
