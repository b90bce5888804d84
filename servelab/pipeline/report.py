"""A one-figure report of a pipeline run (matplotlib).

Four panels: latency CDFs (TTFT, ITL, TPOT, e2e), KV-cache usage and batch
size over steps, tokens scheduled per step, and draft acceptance by position.
Uses ``matplotlib.figure.Figure`` directly (no pyplot), so it never changes
the backend of a notebook or opens a window.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from servelab.pipeline.metrics import RunMetrics


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    x = np.sort(np.asarray(values, dtype=float)) * 1000.0
    ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=label)


def plot_report(run_metrics: RunMetrics | Mapping[str, RunMetrics], path: str | Path, title: str = "") -> Path:
    """Save the report figure of one run (or several, labelled: ``{"fcfs": m1, "sjf": m2}``) to ``path``.

    The format follows the suffix (``.png``, ``.svg``, ``.pdf``); parent
    folders are created. Returns the path.
    """
    from matplotlib.figure import Figure

    runs = dict(run_metrics) if isinstance(run_metrics, Mapping) else {"": run_metrics}
    for label, run in runs.items():
        if not isinstance(run, RunMetrics):
            raise TypeError(f"run_metrics{f'[{label!r}]' if label else ''} must be a RunMetrics, "
                            f"got {type(run).__name__}")
    several = len(runs) > 1
    fig = Figure(figsize=(12, 8), layout="constrained")
    (ax_lat, ax_kv), (ax_tok, ax_acc) = fig.subplots(2, 2)

    for label, run in runs.items():
        prefix = f"{label} " if several else ""
        for name in ("ttft", "itl", "tpot", "e2e"):
            _cdf(ax_lat, getattr(run, f"{name}_values"), f"{prefix}{name.upper()}")
    ax_lat.set_xscale("symlog", linthresh=1.0)
    ax_lat.set(title="Latency CDFs", xlabel="ms", ylabel="fraction of requests / gaps", ylim=(0, 1.02))

    ax_bs = ax_kv.twinx()
    for label, run in runs.items():
        steps = np.arange(1, run.num_steps + 1)
        prefix = f"{label} " if several else ""
        ax_kv.plot(steps, 100 * np.asarray(run.kv_usage), label=f"{prefix}KV usage")
        ax_bs.plot(steps, run.batch_sizes, linestyle="--", alpha=0.7, label=f"{prefix}batch size")
    ax_kv.set(title="KV-cache usage and batch size", xlabel="step", ylabel="KV blocks used (%)", ylim=(0, 102))
    ax_bs.set_ylabel("requests in the batch")
    handles = ax_kv.get_legend_handles_labels()[0] + ax_bs.get_legend_handles_labels()[0]
    if handles:
        ax_kv.legend(handles=handles, loc="upper right", fontsize="small")

    for label, run in runs.items():
        ax_tok.plot(np.arange(1, run.num_steps + 1), run.scheduled_tokens, label=label or "tokens")
    ax_tok.set(title="Tokens scheduled per step", xlabel="step", ylabel="tokens")

    spec = {label: run for label, run in runs.items() if run.acceptance_by_position}
    if spec:
        width = 0.8 / len(spec)
        for n, (label, run) in enumerate(spec.items()):
            pos = np.arange(len(run.acceptance_by_position))
            ax_acc.bar(pos + n * width, run.acceptance_by_position, width,
                       label=f"{label} ({100 * run.acceptance_rate:.0f}% overall)".strip())
        ax_acc.set_xticks(np.arange(max(len(r.acceptance_by_position) for r in spec.values())))
        ax_acc.legend(fontsize="small")
    else:
        speculative = any(run.speculative for run in runs.values())
        ax_acc.text(0.5, 0.5, "speculation on, nothing proposed" if speculative else "no speculative decoding",
                    ha="center", va="center", transform=ax_acc.transAxes)
    ax_acc.set(title="Draft acceptance by position", xlabel="draft position", ylabel="accepted (all up to it)",
               ylim=(0, 1.05))

    if several:
        ax_lat.legend(fontsize="x-small", ncol=2)
        ax_tok.legend(fontsize="small")
    else:
        ax_lat.legend(fontsize="small")
    first = next(iter(runs.values()))
    fig.suptitle(title or f"{first.num_requests} requests, {first.output_tokens} output tokens, "
                          f"{first.throughput_tok_s:.0f} tok/s")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
