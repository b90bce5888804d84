"""Sizes a user gives the command line, checked against the host memory free *before* anything is built.

``servelab simulate --num-requests 1000000000`` or ``servelab blocks --num-blocks 1000000000`` would
otherwise grow for minutes (every request's prompt, every block's bookkeeping object) until the machine
gives out. The estimates are deliberately round and generous, so a refusal means "far beyond this
machine", never "close to the edge": one simulated KV block costs :data:`BYTES_PER_BLOCK` of
bookkeeping (``servelab.pipeline.sizing.HOST_BYTES_PER_BLOCK``, the pipeline's own figure), one request
:data:`BYTES_PER_REQUEST` plus :data:`BYTES_PER_TOKEN` per prompt token (its token list while live).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["BYTES_PER_REQUEST", "BYTES_PER_TOKEN", "check_host_memory", "typical_length"]

BYTES_PER_REQUEST = 2048
"""A request's objects (request, metrics, token times) before its prompt."""
BYTES_PER_TOKEN = 8
"""One prompt token in a live Python list (a pointer; small ints are shared)."""


def _bytes_per_block() -> int:
    from servelab.pipeline.sizing import HOST_BYTES_PER_BLOCK

    return HOST_BYTES_PER_BLOCK


def typical_length(text: str) -> float:
    """The mean of a length distribution written ``fixed:N`` / ``uniform:LO:HI`` / ``lognormal:MED:SIGMA``
    (what :meth:`LengthDist.parse` reads); 0 when it cannot be read (the parser reports that)."""
    try:
        kind, *numbers = text.split(":")
        values = [float(x) for x in numbers]
    except ValueError:
        return 0.0
    if kind == "fixed" and len(values) == 1:
        return values[0]
    if kind == "uniform" and len(values) == 2:
        return (values[0] + values[1]) / 2
    if kind == "lognormal" and len(values) == 2 and values[1] < 10:
        return values[0] * math.exp(values[1] ** 2 / 2)
    return 0.0


def check_host_memory(parts: Sequence[tuple[str, float]], free: int | None = None) -> None:
    """``ValueError`` when the estimated bytes of ``parts`` (``(option text, bytes)``) exceed the host
    memory free now (``free``; default: ``MemAvailable``). Names the largest part and what fits."""
    if free is None:
        from servelab.pipeline.sizing import available_memory_bytes

        free = available_memory_bytes("cpu")
    total = sum(size for _, size in parts)
    if free is None or total <= free:
        return
    option, size = max(parts, key=lambda part: part[1])
    raise ValueError(f"{option} needs about {size / 2**30:,.1f} GiB of host memory (all settings together: "
                     f"{total / 2**30:,.1f} GiB); {free / 2**30:,.1f} GiB is free: lower it")


def simulate_parts(num_requests: int, prompt_len: str, num_blocks: int, replicas: int = 1) -> list[tuple[str, float]]:
    """The memory estimate of a simulated run: its requests and every replica's KV pool bookkeeping."""
    per_request = BYTES_PER_REQUEST + BYTES_PER_TOKEN * typical_length(prompt_len)
    blocks = f"--num-blocks {num_blocks}" + (f" x {replicas} replicas" if replicas > 1 else "")
    return [(f"--num-requests {num_requests}", num_requests * per_request),
            (blocks, float(num_blocks) * replicas * _bytes_per_block())]
