"""``servelab sweep SPEC.toml``: a grid of cluster simulations, locally or on Ray.

The spec format is in :mod:`servelab.cluster.sweep`. Each point's rows go to
the results CSV (``--results``, default ``OUT/results.csv``) and the table
``OUT/sweep.csv`` is rewritten the moment the point finishes, with a progress
line; ``OUT/sweep.png`` is drawn at the end. Both outputs are checked before
the first point runs. A Ctrl-C keeps every finished point and exits 130. A
user mistake (a missing, empty or invalid spec, an unknown key, Ray not
installed, no Ray cluster at ``--address``) prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

USAGE_ERROR = 2


def add_sweep_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``sweep`` subcommand on the console script's subparsers."""
    from servelab.cli.options import DefaultsHelpFormatter

    p = sub.add_parser("sweep", help="run a grid of cluster simulations (routers x replicas x rates ...), "
                                     "in local processes or on Ray", formatter_class=DefaultsHelpFormatter,
                       description=__doc__)
    p.add_argument("spec", help="sweep spec (TOML: [workload], [cluster], [grid])")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="local processes, or Ray tasks (needs pip install 'servelab[ray]')")
    p.add_argument("--address", help="with --executor ray: 'auto' (a running cluster) or 'ray://HEAD:10001' "
                                     "(a remote one); default: start a local Ray instance")
    p.add_argument("--jobs", type=int, default=None, help="local processes (default: the CPU count)")
    p.add_argument("--out", default="servelab-sweep", help="folder for sweep.csv and sweep.png")
    p.add_argument("--results", help="results CSV to append rows to (default: OUT/results.csv)")


def _point_label(point: dict, varying: list[str]) -> str:
    return " ".join(f"{k}={point[k]}" for k in varying) or "run"


def _write_table(results: dict[int, dict], path: Path) -> None:
    """sweep.csv of the finished points, in grid order (rewritten whole, then renamed: never half a file)."""
    rows = [results[i] for i in sorted(results)]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(path.name + ".partial")
    with open(staged, "w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows(rows)
    staged.replace(path)


def _check_args(args: argparse.Namespace):
    """The grid points and output paths, every check made before any point runs."""
    from servelab.cli.bounds import check_host_memory, simulate_parts
    from servelab.cli.options import check_out_dir, check_out_file
    from servelab.cluster.sweep import expand_grid, load_spec

    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs} is invalid; valid: an integer >= 1")
    if args.address is not None and args.executor != "ray":
        raise ValueError("--address applies to --executor ray only")
    if args.jobs is not None and args.executor == "ray":
        raise ValueError("--jobs applies to --executor local only (Ray schedules its own tasks)")
    spec_path = Path(args.spec)
    if not spec_path.is_file():
        raise ValueError(f"spec {args.spec!r} is not a file")
    points = expand_grid(load_spec(spec_path))
    if not points:
        raise ValueError(f"spec {args.spec!r} has an empty grid")
    for point in points:  # every point's size before any runs (each runs in one process)
        replicas = point.get("replicas", 1) if "prefill_replicas" not in point else (
            point.get("prefill_replicas", 0) + point.get("decode_replicas", 0))
        parts = simulate_parts(0 if "trace" in point else point.get("num_requests", 0),
                               str(point.get("prompt_len", "fixed:0")), point.get("num_blocks", 0), replicas)
        check_host_memory([(f"spec {name.removeprefix('--').replace('-', '_')}", size) for name, size in parts])
    out = check_out_dir(args.out)
    results_csv = check_out_file(args.results or out / "results.csv", "--results", results_csv=True)
    return spec_path, points, out, results_csv


def run_sweep_command(args: argparse.Namespace) -> int:
    """Run the sweep, writing each point's rows and the table as the point finishes.

    A Ctrl-C keeps every finished point (rows, table, figure) and exits 130.
    """
    from servelab.cluster.sweep import iter_sweep, plot_sweep, sweep_rows
    from servelab.results import append_rows

    def fail(message: str) -> int:
        print(f"servelab sweep: error: {' '.join(str(message).split())}", file=sys.stderr)
        return USAGE_ERROR

    try:
        spec_path, points, out, results_csv = _check_args(args)
    except (ValueError, TypeError) as exc:
        return fail(str(exc))
    varying = [k for k in points[0] if len({repr(p.get(k)) for p in points}) > 1]
    print(f"servelab sweep: {len(points)} runs on executor {args.executor}; rows to {results_csv} as each "
          "finishes", flush=True)
    results: dict[int, dict] = {}
    interrupted = False
    try:
        for index, result in iter_sweep(points, args.executor, jobs=args.jobs, address=args.address):
            results[index] = result
            append_rows(sweep_rows([result], spec_path.stem), results_csv)
            _write_table(results, out / "sweep.csv")
            failed = f" failed={result['failed']}" if result.get("failed") else ""
            print(f"  [{len(results)}/{len(points)}] {_point_label(points[index], varying)}: "
                  f"ttft_p90={result['ttft_p90']:.3f}s hit={result['prefix_hit_rate']:.3f} "
                  f"imbalance={result['imbalance']:.2f}{failed}", flush=True)
    except KeyboardInterrupt:
        interrupted = True
    except (ValueError, TypeError, ImportError, OSError) as exc:
        message = str(exc)
        if message.startswith("address="):  # the library names its argument; the user typed the option
            message = "--address " + message.removeprefix("address=")
        if not results:
            return fail(message)
        print(f"servelab sweep: error after {len(results)} of {len(points)} points (kept in {out / 'sweep.csv'} "
              f"and {results_csv}): {' '.join(message.split())}", file=sys.stderr)
        return USAGE_ERROR
    ordered = [results[i] for i in sorted(results)]
    figure = plot_sweep(ordered, out / "sweep.png", title=spec_path.stem) if ordered else None
    if interrupted:
        print(f"servelab sweep: interrupted after {len(results)} of {len(points)} points; kept in "
              f"{out / 'sweep.csv'}, {results_csv} and {figure}", file=sys.stderr)
        return 130
    print(f"servelab sweep: table {out / 'sweep.csv'}, rows {results_csv}, figure {figure}")
    # the exit rule of every command: 0 all served, 1 some requests failed, 2 every request failed
    failed, total = sum(r.get("failed", 0) for r in ordered), sum(r.get("requests", 0) for r in ordered)
    if failed and failed == total:
        return fail(f"all {total} requests of every point failed: the KV pool (num_blocks) cannot hold them")
    if failed:
        print(f"servelab sweep: {failed} of {total} requests failed (the failed column of {out / 'sweep.csv'})",
              file=sys.stderr)
        return 1
    return 0
