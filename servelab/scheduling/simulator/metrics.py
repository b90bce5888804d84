"""Serving metrics of a simulation: latencies, throughput, goodput, cache, fairness.

Definitions (times on the simulator's virtual clock, in seconds):

- TTFT: arrival to first output token. ITL: gap between consecutive tokens of
  a request. TPOT: (last token - first token) / (output tokens - 1). e2e:
  arrival to finish.
- throughput: output tokens (and requests) per second of simulated time from
  the first arrival to the last finish.
- goodput: requests per second that finished normally *and* met both SLOs
  (TTFT <= ``ttft_slo_s``, TPOT <= ``tpot_slo_s``; a one-token request has no
  TPOT and only needs the TTFT SLO).
- prefix-cache hit rate: prompt tokens found in the cache on each request's
  first admission / all prompt tokens.
- per-client service: prompt + 2 x output tokens (the VTC weights) of each
  client's finished requests, and its share of the total.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from servelab.scheduling.request import RequestMetrics
from servelab.scheduling.simulator.quantiles import streaming_percentiles


@dataclass(frozen=True)
class LatencySummary:
    """A latency's mean and percentiles over the requests that finished, with the count of those
    that failed beside it: an average over survivors never hides the failures.

    Attributes:
        count: samples summarised (requests, or gaps for ITL).
        failed: requests of the run that failed (finish reason ``"error"``) and so have no sample.
    """

    mean: float
    p50: float
    p90: float
    p99: float
    count: int
    failed: int = 0

    @classmethod
    def of(cls, values: np.ndarray | list[float], failed: int = 0) -> LatencySummary:
        if isinstance(failed, bool) or not isinstance(failed, int) or failed < 0:
            raise ValueError(f"failed={failed!r} is invalid; valid: an int >= 0")
        a = np.asarray(values, dtype=float)
        if a.size == 0:
            return cls(float("nan"), float("nan"), float("nan"), float("nan"), 0, failed)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(float(a.mean()), float(p50), float(p90), float(p99), int(a.size), failed)


def inter_token_gaps(requests: list[RequestMetrics], batch: int = 4096) -> np.ndarray:
    """Every request's gaps between consecutive token times, concatenated in order (float64,
    ``[sum(len(token_times) - 1)]``), ``batch`` requests at a time: a per-request array each (and
    their concatenation) would take twice a million-request run's token times again."""
    times = [m.token_times for m in requests if len(m.token_times) > 1]
    out = np.empty(sum(len(t) for t in times) - len(times))
    pos = 0
    for gaps in _gap_chunks(times, batch):
        out[pos:pos + len(gaps)] = gaps
        pos += len(gaps)
    return out


def _gap_chunks(times: list[list[float]], batch: int = 4096) -> Iterator[np.ndarray]:
    """The gaps of ``batch`` requests' token times at a time (float64 arrays), in request order."""
    for lo in range(0, len(times), batch):
        chunk = times[lo:lo + batch]
        lengths = np.fromiter((len(t) for t in chunk), dtype=np.int64, count=len(chunk))
        flat = np.fromiter(itertools.chain.from_iterable(chunk), dtype=float, count=int(lengths.sum()))
        gaps = np.diff(flat)
        keep = np.ones(len(gaps), dtype=bool)
        keep[np.cumsum(lengths)[:-1] - 1] = False  # the gap from one request's last token to the next's first
        yield gaps[keep]


def itl_summary(requests: list[RequestMetrics], failed: int = 0) -> LatencySummary:
    """:meth:`LatencySummary.of` of :func:`inter_token_gaps` without holding the gaps (a
    million-request run's would take 1 GB): percentiles exact (:mod:`.quantiles`), the mean the
    sum of per-batch sums over the count."""
    times = [m.token_times for m in requests if len(m.token_times) > 1]
    count, mean, (p50, p90, p99) = streaming_percentiles(lambda: _gap_chunks(times), (50, 90, 99))
    return LatencySummary(mean, p50, p90, p99, count, failed)


@dataclass(frozen=True)
class ClientStats:
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    service: float
    share: float
    mean_ttft: float
    mean_e2e: float


@dataclass
class SimulationResult:
    """Everything one simulated run produced; :meth:`summary` flattens it."""

    policy: str
    requests: list[RequestMetrics]
    num_steps: int
    num_preemptions: int
    kv_times: np.ndarray
    kv_usage: np.ndarray
    wall_s: float
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        ok = [m for m in self.requests if m.finish_reason in ("stop", "length")]
        self._ok = ok
        self._ttft = np.array([m.ttft for m in ok if m.ttft is not None])
        self._tpot = np.array([m.tpot for m in ok if m.tpot is not None])
        self._e2e = np.array([m.e2e for m in ok])
        self._itl: np.ndarray | None = None  # built on first read: 1 GB for a million requests
        self._itl_summary: LatencySummary | None = None

    # ---- latencies ---------------------------------------------------------

    @property
    def ttft(self) -> np.ndarray:
        return self._ttft

    @property
    def tpot(self) -> np.ndarray:
        return self._tpot

    @property
    def itl(self) -> np.ndarray:
        if self._itl is None:
            self._itl = inter_token_gaps(self._ok)
        return self._itl

    @property
    def e2e(self) -> np.ndarray:
        return self._e2e

    def latency(self, name: str) -> LatencySummary:
        """Summary of ``"ttft"``, ``"itl"``, ``"tpot"`` or ``"e2e"`` over the finished requests,
        with ``failed`` (the requests that have no sample because they failed) beside it."""
        if name not in ("ttft", "itl", "tpot", "e2e"):
            raise ValueError(f"latency name {name!r}; valid: ttft, itl, tpot, e2e")
        if name == "itl":  # the gaps are never held for this (see itl_summary)
            if self._itl_summary is None:
                self._itl_summary = itl_summary(self._ok, self.num_failed)
            return self._itl_summary
        return LatencySummary.of(getattr(self, name), failed=self.num_failed)

    # ---- rates -------------------------------------------------------------------

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        start = min(m.arrival_time for m in self.requests)
        end = max(m.finish_time for m in self.requests if m.finish_time is not None)
        return max(end - start, 1e-12)

    @property
    def num_output_tokens(self) -> int:
        return sum(m.num_output_tokens for m in self.requests)

    @property
    def throughput_tok_s(self) -> float:
        return self.num_output_tokens / self.duration_s if self.requests else 0.0

    @property
    def throughput_req_s(self) -> float:
        return len(self._ok) / self.duration_s if self.requests else 0.0

    def meets_slo(self, m: RequestMetrics) -> bool:
        if m.finish_reason not in ("stop", "length") or m.ttft is None or m.ttft > self.ttft_slo_s:
            return False
        tpot = m.tpot
        return tpot is None or tpot <= self.tpot_slo_s

    @property
    def goodput_req_s(self) -> float:
        return sum(map(self.meets_slo, self.requests)) / self.duration_s if self.requests else 0.0

    @property
    def slo_attainment(self) -> float:
        return sum(map(self.meets_slo, self.requests)) / len(self.requests) if self.requests else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        prompt = sum(m.num_prompt_tokens for m in self.requests)
        return sum(m.num_cached_tokens for m in self.requests) / prompt if prompt else 0.0

    @property
    def num_failed(self) -> int:
        return sum(m.finish_reason == "error" for m in self.requests)

    @property
    def mean_kv_usage(self) -> float:
        return float(self.kv_usage.mean()) if self.kv_usage.size else 0.0

    # ---- fairness ------------------------------------------------------------------

    def per_client(self) -> dict[str, ClientStats]:
        groups: dict[str, list[RequestMetrics]] = {}
        for m in self._ok:
            groups.setdefault(m.client_id, []).append(m)
        service = {c: sum(m.num_prompt_tokens + 2 * m.num_output_tokens for m in ms) for c, ms in groups.items()}
        total = sum(service.values()) or 1.0
        out = {}
        for client in sorted(groups):
            ms = groups[client]
            ttfts = [m.ttft for m in ms if m.ttft is not None]
            out[client] = ClientStats(
                len(ms), sum(m.num_prompt_tokens for m in ms), sum(m.num_output_tokens for m in ms),
                service[client], service[client] / total,
                float(np.mean(ttfts)) if ttfts else float("nan"), float(np.mean([m.e2e for m in ms])))
        return out

    def summary(self) -> dict[str, float]:
        """Flat metrics (seconds for latencies) for tables and CSV: the policy (the row's label), then
        ``failed`` leads the numbers (latencies are over the finished requests only, so the failures
        are read first)."""
        row: dict[str, float] = {"policy": self.policy, "failed": self.num_failed, "requests": len(self.requests)}
        for name in ("ttft", "tpot", "itl", "e2e"):
            s = self.latency(name)
            row.update({f"{name}_mean": s.mean, f"{name}_p50": s.p50, f"{name}_p90": s.p90, f"{name}_p99": s.p99})
        row.update({
            "throughput_tok_s": self.throughput_tok_s, "throughput_req_s": self.throughput_req_s,
            "goodput_req_s": self.goodput_req_s, "slo_attainment": self.slo_attainment,
            "prefix_hit_rate": self.prefix_hit_rate, "preemptions": self.num_preemptions,
            "mean_kv_usage": self.mean_kv_usage, "steps": self.num_steps, "sim_s": self.duration_s,
            "wall_s": self.wall_s,
        })
        return row
