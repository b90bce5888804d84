"""Tables and figures for simulation results."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from servelab.scheduling.simulator.metrics import SimulationResult

_COLUMNS = [
    ("policy", "policy", "{}"), ("failed", "failed", "{}"), ("ttft_p50", "TTFT p50 s", "{:.3f}"), ("ttft_p99", "TTFT p99 s", "{:.3f}"),
    ("tpot_p50", "TPOT p50 ms", "{:.1f}"), ("tpot_p99", "TPOT p99 ms", "{:.1f}"),
    ("itl_p99", "ITL p99 ms", "{:.1f}"), ("e2e_p50", "e2e p50 s", "{:.2f}"), ("e2e_p99", "e2e p99 s", "{:.2f}"),
    ("throughput_tok_s", "tok/s", "{:.0f}"), ("goodput_req_s", "goodput req/s", "{:.2f}"),
    ("prefix_hit_rate", "prefix hit", "{:.1%}"), ("preemptions", "preempt", "{}"),
    ("mean_kv_usage", "KV use", "{:.1%}"), ("wall_s", "wall s", "{:.1f}"),
]
_MS = {"tpot_p50", "tpot_p99", "itl_p99"}
# "failed" right after the policy: the latencies beside it are over the finished requests only


def format_table(results: Sequence[SimulationResult]) -> str:
    """One row per result, fixed-width columns."""
    rows = []
    for r in results:
        s = r.summary()
        rows.append([fmt.format(s[k] * 1000 if k in _MS else s[k]) for k, _, fmt in _COLUMNS])
    headers = [h for _, h, _ in _COLUMNS]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def format_client_table(results: Sequence[SimulationResult]) -> str:
    """Per-client service share and latency, one block of rows per policy."""
    lines = [f"{'policy':>8}  {'client':>10}  {'requests':>8}  {'service share':>13}  {'mean TTFT s':>11}  "
             f"{'mean e2e s':>10}"]
    for r in results:
        for client, c in r.per_client().items():
            lines.append(f"{r.policy:>8}  {client:>10}  {c.num_requests:>8}  {c.share:>13.1%}  "
                         f"{c.mean_ttft:>11.3f}  {c.mean_e2e:>10.2f}")
    return "\n".join(lines)


def write_csv(results: Sequence[SimulationResult], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r.summary() for r in results]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _cdf(ax, values: np.ndarray, label: str) -> None:
    if values.size:
        v = np.sort(values)
        ax.plot(v, np.arange(1, v.size + 1) / v.size, label=label)


def plot_results(results: Sequence[SimulationResult], path: str | Path, title: str = "") -> Path:
    """Latency CDFs (TTFT, TPOT, e2e) and KV usage over time, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for r in results:
        _cdf(axes[0, 0], r.ttft, r.policy)
        _cdf(axes[0, 1], r.tpot * 1000, r.policy)
        _cdf(axes[1, 0], r.e2e, r.policy)
        # Thin the series: tens of thousands of steps are more points than pixels.
        stride = max(1, r.kv_times.size // 2000)
        axes[1, 1].plot(r.kv_times[::stride], r.kv_usage[::stride] * 100, label=r.policy, lw=0.8)
    for ax, xlabel, scale in ((axes[0, 0], "TTFT (s)", "log"), (axes[0, 1], "TPOT (ms)", "linear"),
                              (axes[1, 0], "end-to-end latency (s)", "log")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests")
        ax.set_xscale(scale)
        ax.grid(alpha=0.3)
    axes[1, 1].set_xlabel("simulated time (s)")
    axes[1, 1].set_ylabel("KV cache usage (%)")
    axes[1, 1].grid(alpha=0.3)
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:  # a run where every request failed draws no line
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
