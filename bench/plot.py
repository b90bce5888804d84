"""Draw any component's benchmark rows, or render the results file as markdown.

    python bench/plot.py --component blocks                       # -> bench/results/blocks.png
    python bench/plot.py --component scheduler --metric steps_per_s --param num_requests
    python bench/plot.py --markdown [--component sampler] [--all]

Rows come from ``bench/results/results.csv`` (see ``results_io.py``). For a
plot, each metric of the component is one panel; the x axis is one parameter
(``--param``, default: the first parameter whose value varies), one series per
implementation (and per combination of the other varying parameters); the
marker is ``value`` and the error bar spans ``p20``..``p80``. Only the latest
row of each (implementation, metric, params) is drawn, so re-running a
benchmark updates the picture while the CSV keeps the history. The markdown
view is a table of the same latest rows (``--all``: every row).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import RESULTS_CSV, read_rows  # noqa: E402


def _key(row: dict) -> tuple:
    return (row["component"], row["implementation"], row["metric"], json.dumps(row["params"], sort_keys=True),
            row["device"])


def latest(rows: Sequence[dict]) -> list[dict]:
    """The last row of each (component, implementation, metric, params, device), in first-seen order."""
    last: dict[tuple, dict] = {}
    for row in rows:
        last.pop(_key(row), None)
        last[_key(row)] = row
    return sorted(last.values(), key=lambda r: [str(x) for x in _key(r)])


def varying_params(rows: Sequence[dict]) -> list[str]:
    """Parameter names whose value differs between ``rows``, in first-seen order."""
    names: dict[str, set] = {}
    for row in rows:
        for name, value in row["params"].items():
            names.setdefault(name, set()).add(json.dumps(value))
    return [n for n, values in names.items() if len(values) > 1 or any(n not in r["params"] for r in rows)]


def _x_positions(values: list) -> tuple[list[float], list[str] | None]:
    """Numbers stay numbers; anything else becomes categorical ticks."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return [float(v) for v in values], None
    labels = sorted({str(v) for v in values})
    return [float(labels.index(str(v))) for v in values], labels


def plot_component(rows: Sequence[dict], component: str, *, metric: str | None = None,
                   param: str | None = None, out: str | Path | None = None) -> Path:
    """Draw ``component``'s latest rows to ``out`` (PNG; default
    ``bench/results/<component>.png``) and return the path. ``ValueError``
    when there is nothing to draw or ``param`` is not a parameter of the rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = latest([r for r in rows if r["component"] == component and (metric is None or r["metric"] == metric)])
    if not chosen:
        known = sorted({r["component"] + "/" + r["metric"] for r in rows})
        raise ValueError(f"no rows for component={component!r} metric={metric!r}; known: {known}")
    metrics = list(dict.fromkeys(r["metric"] for r in chosen))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, name in zip(axes[0], metrics):
        _draw_metric(ax, [r for r in chosen if r["metric"] == name], name, param)
    fig.suptitle(f"{component} ({chosen[0]['device']}, git {chosen[-1]['git_sha']})")
    fig.tight_layout()
    path = Path(out) if out else RESULTS_CSV.parent / f"{component}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_metric(ax, rows: list[dict], metric: str, param: str | None) -> None:
    varying = varying_params(rows)
    if param is not None and all(param not in r["params"] for r in rows):
        known = sorted({k for r in rows for k in r["params"]})
        raise ValueError(f"param {param!r} is not a parameter of metric {metric!r}; known: {known}")
    x_name = param if param is not None else (varying[0] if varying else None)
    others = [p for p in varying if p != x_name]
    groups: dict[str, list[dict]] = {}
    for row in rows:
        label = row["implementation"] + "".join(f", {p}={row['params'].get(p)}" for p in others)
        groups.setdefault(label, []).append(row)
    all_x = [r["params"].get(x_name, "-") if x_name else "-" for r in rows]
    _, ticks = _x_positions(all_x)
    for index, (label, group) in enumerate(groups.items()):
        group.sort(key=lambda r: str(r["params"].get(x_name, "")) if ticks else r["params"].get(x_name, 0))
        xs = [r["params"].get(x_name, "-") if x_name else "-" for r in group]
        # Categories: no connecting line, series side by side around the tick.
        shift = (index - (len(groups) - 1) / 2) * 0.08
        pos = [ticks.index(str(x)) + shift for x in xs] if ticks else [float(x) for x in xs]
        ys = [r["value"] for r in group]
        lo = [r["value"] - r["p20"] if r["p20"] is not None else 0.0 for r in group]
        hi = [r["p80"] - r["value"] if r["p80"] is not None else 0.0 for r in group]
        err = [[max(v, 0.0) for v in lo], [max(v, 0.0) for v in hi]]
        ax.errorbar(pos, ys, yerr=err, marker="o", capsize=3, label=label, linestyle="none" if ticks else "-")
    if ticks:
        ax.set_xticks(range(len(ticks)), ticks, rotation=30 if len(ticks) > 3 else 0, ha="right")
    ax.set(xlabel=x_name or "", ylabel=f"{metric} ({rows[0]['unit']})", title=metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _fmt(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def markdown_table(rows: Sequence[dict], *, all_rows: bool = False) -> str:
    """A markdown table of ``rows`` (latest per key unless ``all_rows``)."""
    shown = list(rows) if all_rows else latest(rows)
    head = ["component", "implementation", "metric", "params", "value", "p20", "p80", "unit", "device",
            "git", "date"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in shown:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items())
        cells = [r["component"], r["implementation"], r["metric"], params, _fmt(r["value"]), _fmt(r["p20"]),
                 _fmt(r["p80"]), r["unit"], r["device"], r["git_sha"], r["date"]]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default=None, help=f"results file (default {RESULTS_CSV})")
    parser.add_argument("--component", help="component to draw (or to filter the markdown by)")
    parser.add_argument("--metric", help="draw only this metric")
    parser.add_argument("--param", help="parameter on the x axis (default: first one that varies)")
    parser.add_argument("--out", help="PNG path (default bench/results/<component>.png)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table instead of plotting")
    parser.add_argument("--all", action="store_true", help="markdown: every row, not only the latest per key")
    args = parser.parse_args(argv)
    rows = read_rows(args.csv or RESULTS_CSV, component=args.component)
    if args.markdown:
        print(markdown_table(rows, all_rows=args.all))
        return 0
    if not args.component:
        components = sorted({r["component"] for r in rows})
        parser.error(f"--component is required to plot; components in the file: {components}")
    try:
        path = plot_component(rows, args.component, metric=args.metric, param=args.param, out=args.out)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
