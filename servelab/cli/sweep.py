"""``servelab sweep SPEC.toml``: a grid of cluster simulations, locally or on Ray.

The spec format is in :mod:`servelab.cluster.sweep`. Rows go to the results
CSV (``--results``, default ``OUT/results.csv``), a table to ``OUT/sweep.csv``
and a figure to ``OUT/sweep.png``. A user mistake (a missing or invalid spec,
an unknown key, Ray not installed) prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

USAGE_ERROR = 2


def add_sweep_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``sweep`` subcommand on the console script's subparsers."""
    p = sub.add_parser("sweep", help="run a grid of cluster simulations (routers x replicas x rates ...), "
                                     "in local processes or on Ray")
    p.add_argument("spec", help="sweep spec (TOML: [workload], [cluster], [grid])")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="local processes (default) or Ray tasks (needs servelab[ray])")
    p.add_argument("--address", help="Ray address: 'auto' (a running cluster), 'ray://HEAD:10001'; "
                                     "default: start a local Ray instance")
    p.add_argument("--jobs", type=int, default=None, help="local processes (default: CPU count)")
    p.add_argument("--out", default="servelab-sweep", help="folder for sweep.csv and sweep.png")
    p.add_argument("--results", help="results CSV to append rows to (default: OUT/results.csv)")


def run_sweep_command(args: argparse.Namespace) -> int:
    from servelab.cluster.sweep import expand_grid, load_spec, plot_sweep, run_sweep, sweep_rows
    from servelab.results import append_rows

    def fail(message: str) -> int:
        print(f"servelab sweep: error: {' '.join(str(message).split())}", file=sys.stderr)
        return USAGE_ERROR

    if args.jobs is not None and args.jobs < 1:
        return fail(f"--jobs {args.jobs} is invalid; valid: an integer >= 1")
    if args.address is not None and args.executor != "ray":
        return fail("--address applies to --executor ray only")
    spec_path = Path(args.spec)
    if not spec_path.is_file():
        return fail(f"spec {args.spec!r} is not a file")
    try:
        points = expand_grid(load_spec(spec_path))
        if not points:
            return fail(f"spec {args.spec!r} has an empty grid")
        print(f"servelab sweep: {len(points)} runs on executor {args.executor}", flush=True)
        results = run_sweep(points, args.executor, jobs=args.jobs, address=args.address)
    except (ValueError, TypeError, ImportError) as exc:
        return fail(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in results for k in r))
    with open(out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows(results)
    written = append_rows(sweep_rows(results, spec_path.stem), args.results or out / "results.csv")
    figure = plot_sweep(results, out / "sweep.png", title=spec_path.stem)
    for r in results:
        print(f"  {r['router']:>16} replicas={r['replicas']} ttft_p90={r['ttft_p90']:.3f}s "
              f"hit={r['prefix_hit_rate']:.3f} imbalance={r['imbalance']:.2f}")
    print(f"servelab sweep: table {out / 'sweep.csv'}, rows {written}, figure {figure}")
    return 1 if any(r.get("failed") for r in results) else 0
