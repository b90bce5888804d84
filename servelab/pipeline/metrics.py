"""Run metrics of the pipeline: per step (KV usage, batch size, scheduled tokens,
step time) and per request (TTFT, ITL, TPOT, e2e), summarised per run.

Definitions match the scheduling simulator's
(:mod:`servelab.scheduling.simulator.metrics`), so a simulated run and a real
one can be laid side by side: latencies over requests that finished normally
(``"stop"`` / ``"length"``), in seconds of the pipeline's clock
(``time.perf_counter``); TTFT from arrival (``add_request``) to the first
token; ITL between consecutive tokens (tokens accepted together in one step
are 0 apart); TPOT = (last - first token time) / (tokens - 1); prefix-cache
hit rate = prompt tokens found cached on each request's first admission / all
prompt tokens. Throughput counts only work that was delivered: output tokens
of requests that did not fail (``finish_reason != "error"``) / wall time, and
requests that finished normally / wall time — a run where every request
fails has throughput 0, whatever its speed. Memory: the process's peak
resident set size (``peak_rss_bytes``, the whole process so far, not only
this run) beside the KV pool's size (``kv_cache_bytes``).
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from servelab.samplers import AcceptanceStats
from servelab.scheduling.request import RequestMetrics
from servelab.scheduling.simulator.metrics import LatencySummary

_NORMAL = ("stop", "length")


@dataclass
class RunMetrics:
    """Everything one run (a ``generate`` or ``stream`` call) measured.

    Per-step lists (``kv_usage``, ``batch_sizes``, ``scheduled_tokens``,
    ``kv_tokens`` (KV positions attention read), ``step_times``) have one entry
    per scheduler step; ``StepCostModel.from_run`` fits the simulator's cost
    model to them; ``kv_usage`` is the
    fraction of usable KV blocks held right after scheduling (the step's peak).
    ``acceptance_rate`` is None without speculative decoding (``speculative``
    False) or when speculation is on but no draft was verified (nothing
    proposed); ``acceptance_by_position[j]`` is, among request-steps that
    proposed a draft at position ``j``, the fraction whose drafts ``0..j`` were
    all accepted (so it falls with ``j``).
    """

    num_requests: int
    finish_reasons: dict[str, int]
    num_steps: int
    wall_time_s: float
    prompt_tokens: int
    output_tokens: int
    throughput_tok_s: float
    ttft: LatencySummary
    itl: LatencySummary
    tpot: LatencySummary
    e2e: LatencySummary
    prefix_cache_hit_rate: float
    num_preemptions: int
    acceptance_rate: float | None
    acceptance_by_position: list[float]
    mean_accepted_per_step: float | None
    num_draft_tokens: int
    num_accepted_tokens: int
    kv_usage: list[float]
    batch_sizes: list[int]
    scheduled_tokens: list[int]
    step_times: list[float]
    kv_tokens: list[int] = field(default_factory=list)
    speculative: bool = False
    peak_rss_bytes: int = 0
    kv_cache_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    """The distinct error messages of failed requests (first 10)."""
    ttft_values: list[float] = field(repr=False, default_factory=list)
    itl_values: list[float] = field(repr=False, default_factory=list)
    tpot_values: list[float] = field(repr=False, default_factory=list)
    e2e_values: list[float] = field(repr=False, default_factory=list)
    requests: list[RequestMetrics] = field(repr=False, default_factory=list)

    @property
    def num_errors(self) -> int:
        return self.finish_reasons.get("error", 0)

    @property
    def num_completed(self) -> int:
        """Requests that finished normally ("stop" or "length")."""
        return sum(self.finish_reasons.get(r, 0) for r in _NORMAL)

    @property
    def request_throughput(self) -> float:
        """Requests that finished normally per second of wall time (failures do not count)."""
        return self.num_completed / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def mean_kv_usage(self) -> float:
        return float(np.mean(self.kv_usage)) if self.kv_usage else 0.0

    @property
    def mean_batch_size(self) -> float:
        return float(np.mean(self.batch_sizes)) if self.batch_sizes else 0.0

    def table(self) -> str:
        """A human-readable two-column table (latencies in ms)."""
        def lat(s: LatencySummary) -> str:
            if not s.count:
                return "n/a"
            return " / ".join(f"{1000 * v:.2f}" for v in (s.mean, s.p50, s.p90, s.p99))

        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.finish_reasons.items()))
        if self.acceptance_rate is None:
            accept = "n/a (speculation on, nothing proposed)" if self.speculative else "n/a (no speculative decoding)"
        else:
            by_pos = ", ".join(f"{100 * a:.0f}%" for a in self.acceptance_by_position)
            accept = f"{100 * self.acceptance_rate:.1f} % (by position: {by_pos})"
        rows = [
            ("requests", f"{self.num_requests} ({reasons})" if reasons else str(self.num_requests)),
            ("steps", str(self.num_steps)),
            ("wall time", f"{self.wall_time_s:.3f} s"),
            ("prompt / output tokens", f"{self.prompt_tokens} / {self.output_tokens}"),
            ("throughput", f"{self.throughput_tok_s:.1f} tok/s ({self.request_throughput:.2f} req/s)"),
            ("TTFT mean/p50/p90/p99", lat(self.ttft) + " ms"),
            ("ITL  mean/p50/p90/p99", lat(self.itl) + " ms"),
            ("TPOT mean/p50/p90/p99", lat(self.tpot) + " ms"),
            ("e2e  mean/p50/p90/p99", lat(self.e2e) + " ms"),
            ("prefix-cache hit rate", f"{100 * self.prefix_cache_hit_rate:.1f} %"),
            ("preemptions", str(self.num_preemptions)),
            ("acceptance rate", accept),
            ("KV usage mean / peak", f"{100 * self.mean_kv_usage:.1f} % / "
                                     f"{100 * max(self.kv_usage, default=0.0):.1f} %"),
            ("batch size mean / max", f"{self.mean_batch_size:.1f} / {max(self.batch_sizes, default=0)}"),
            ("memory: peak RSS / KV pool", f"{_mib(self.peak_rss_bytes)} / {_mib(self.kv_cache_bytes)}"),
        ]
        if self.errors:
            rows.append(("first error", self.errors[0] if len(self.errors) == 1 else
                         f"{self.errors[0]} (+{len(self.errors) - 1} other messages)"))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: scalars, summaries as dicts, per-step lists (NaN -> None)."""
        def clean(value: Any) -> Any:
            if isinstance(value, float) and math.isnan(value):
                return None
            if isinstance(value, LatencySummary):
                return {f.name: clean(getattr(value, f.name)) for f in fields(value)}
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            if isinstance(value, list):
                return [clean(v) for v in value]
            return value

        out = {f.name: clean(getattr(self, f.name)) for f in fields(self) if f.name != "requests"}
        out.update(num_errors=self.num_errors, num_completed=self.num_completed,
                   request_throughput=self.request_throughput,
                   mean_kv_usage=self.mean_kv_usage, mean_batch_size=self.mean_batch_size)
        return out


def _mib(num_bytes: int) -> str:
    """A byte count for people: ``"436 MiB"``, ``"1.21 GiB"``, ``"96 KiB"`` (``"n/a"`` for 0: unknown)."""
    if not num_bytes:
        return "n/a"
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if num_bytes >= 1 << shift:
            value = num_bytes / (1 << shift)
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{num_bytes / 1024:.0f} KiB"


class MetricsRecorder:
    """Collects one run's steps and finished requests; :meth:`finish` summarises.

    Args:
        start_time: the run's start on the pipeline clock.
        speculative: whether speculative decoding is on (else acceptance is None).
    """

    def __init__(self, start_time: float, speculative: bool = False) -> None:
        self.start_time = start_time
        self.speculative = speculative
        self.kv_usage: list[float] = []
        self.batch_sizes: list[int] = []
        self.scheduled_tokens: list[int] = []
        self.step_times: list[float] = []
        self.kv_tokens: list[int] = []
        self.acceptance = AcceptanceStats()
        self.requests: list[RequestMetrics] = []
        self.errors: list[str] = []

    def record_step(self, kv_usage: float, batch_size: int, scheduled_tokens: int, step_time: float,
                    verification: Sequence[tuple[int, int]] = (), kv_tokens: int = 0) -> None:
        self.kv_tokens.append(int(kv_tokens))
        self.kv_usage.append(float(kv_usage))
        self.batch_sizes.append(int(batch_size))
        self.scheduled_tokens.append(int(scheduled_tokens))
        self.step_times.append(float(step_time))
        if verification:
            self.acceptance.update([d for d, _ in verification], [a for _, a in verification])

    def record_request(self, metrics: RequestMetrics, error: str | None = None) -> None:
        self.requests.append(metrics)
        if error is not None and error not in self.errors and len(self.errors) < 10:
            self.errors.append(error)

    def finish(self, end_time: float, *, peak_rss_bytes: int = 0, kv_cache_bytes: int = 0) -> RunMetrics:
        """Summarise the run up to ``end_time``; memory figures are passed in by the pipeline."""
        reqs = self.requests
        ok = [m for m in reqs if m.finish_reason in _NORMAL]
        ttft = [m.ttft for m in ok if m.ttft is not None]
        tpot = [m.tpot for m in ok if m.tpot is not None]
        e2e = [m.e2e for m in ok if m.e2e is not None]
        itl = [gap for m in ok for gap in m.itl]
        wall = max(end_time - self.start_time, 1e-12)
        output_tokens = sum(m.num_output_tokens for m in reqs)
        delivered = sum(m.num_output_tokens for m in reqs if m.finish_reason != "error")
        prompt_tokens = sum(m.num_prompt_tokens for m in reqs)
        stats = self.acceptance
        verified = self.speculative and stats.num_draft_tokens > 0
        return RunMetrics(
            num_requests=len(reqs),
            finish_reasons=dict(Counter(m.finish_reason for m in reqs if m.finish_reason)),
            num_steps=len(self.step_times),
            wall_time_s=wall,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            throughput_tok_s=delivered / wall,
            ttft=LatencySummary.of(ttft), itl=LatencySummary.of(itl), tpot=LatencySummary.of(tpot),
            e2e=LatencySummary.of(e2e),
            prefix_cache_hit_rate=(sum(m.num_cached_tokens for m in reqs) / prompt_tokens) if prompt_tokens else 0.0,
            num_preemptions=sum(m.num_preemptions for m in reqs),
            acceptance_rate=stats.acceptance_rate if verified else None,
            acceptance_by_position=stats.per_position_acceptance_rate if verified else [],
            mean_accepted_per_step=stats.mean_accepted_per_step if verified else None,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
            kv_usage=self.kv_usage, batch_sizes=self.batch_sizes, scheduled_tokens=self.scheduled_tokens,
            step_times=self.step_times, kv_tokens=self.kv_tokens, speculative=self.speculative,
            peak_rss_bytes=int(peak_rss_bytes), kv_cache_bytes=int(kv_cache_bytes), errors=list(self.errors),
            ttft_values=ttft, itl_values=itl, tpot_values=tpot, e2e_values=e2e, requests=list(reqs),
        )


class ProgressBar:
    """tqdm when available, else a line on stderr at most once a second; no-op when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done, self.tokens = total, enabled, 0, 0
        self.start = self.last = time.perf_counter()
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, finished: int, tokens: int) -> None:
        if not self.enabled:
            return
        self.done += finished
        self.tokens += tokens
        now = time.perf_counter()
        rate = self.tokens / max(now - self.start, 1e-9)
        if self.bar is not None:
            if finished:
                self.bar.update(finished)
            if now - self.last > 0.2:
                self.bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
                self.last = now
        elif now - self.last > 1.0 or self.done == self.total:
            print(f"generate: {self.done}/{self.total} requests, {rate:.0f} tok/s", file=sys.stderr)
            self.last = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
