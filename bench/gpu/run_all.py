"""Run every GPU benchmark section and print / save one table.

    python bench/gpu/run_all.py                 # on a CUDA machine, < 8 minutes
    python bench/gpu/run_all.py --cpu-smoke     # dry run of the Python on CPU (interpreter, tiny sizes)

Steps: measure the device's copy bandwidth, then import every
``bench/gpu/sec_*.py`` (sorted by name) and call its ``run(ctx)``; each
section checks its kernels against their references on fresh random data and
times them against peers. The table is printed last and every row is appended
to ``bench/results/results.csv`` through :mod:`servelab.results` (the project's
one results schema: component ``gpu-<section>``, the implementation, metric
``time`` in ms — or ``copy_bandwidth`` in GB/s for the device row —, the case,
bandwidth, peer ratio and check in ``params``, device ``cuda:<card>``); with
``--out-dir`` (and always with ``--cpu-smoke``) to ``<out-dir>/results.csv``.

Section contract: ``run(ctx) -> list[dict]``; each row has the keys of
``ROW_KEYS`` (``None`` where not applicable) and may add its own (extra
columns are kept). ``ctx`` offers ``device``, ``copy_gbps``, ``smoke``,
``card``, ``bench(fn) -> ms`` and ``time_left() -> s``. A section that raises,
or a row whose ``check`` starts with ``FAIL``, makes the script exit 1 after
the table is written; the other sections still run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ROW_KEYS = ("section", "case", "impl", "ms", "gbps", "frac_copy_bw", "vs_peer", "check")
COPY_MIB = {False: 2048, True: 64}  # copy-bandwidth tensor size: GPU, --cpu-smoke
TIME_BUDGET_S = 7.5 * 60  # the whole script must finish in under 8 minutes


@dataclass
class BenchContext:
    """What a section gets: where to run, the bandwidth yardstick, a timer."""

    device: Any                # torch.device
    copy_gbps: float           # measured copy bandwidth, GB/s counted as read + write
    smoke: bool = False        # --cpu-smoke: tiny sizes, CPU tensors, interpreter
    card: str = ""
    deadline: float = field(default_factory=lambda: time.monotonic() + TIME_BUDGET_S)

    def time_left(self) -> float:
        """Seconds left of the script's budget; sections trim their grids with it."""
        return self.deadline - time.monotonic()

    def bench(self, fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
        """Median milliseconds of ``fn()``; on a GPU the L2 cache is flushed between runs."""
        if self.smoke:
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def measure_copy_gbps(torch, device, smoke: bool) -> float:
    """Device-to-device copy of a large tensor; bytes read + bytes written per second."""
    numel = COPY_MIB[smoke] * 1024 * 1024 // 4   # 2 GiB of float32 on a GPU: far beyond L2
    src = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    if smoke:
        dst.copy_(src)
        start = time.perf_counter()
        dst.copy_(src)
        seconds = time.perf_counter() - start
    else:
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize(device)
        times = []
        for _ in range(10):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        seconds = sorted(times)[len(times) // 2]
    gbps = 2 * src.numel() * src.element_size() / seconds / 1e9
    del src, dst
    return gbps


def discover_sections(only: list[str] | None) -> list[Path]:
    paths = sorted(HERE.glob("sec_*.py"))
    if only:
        paths = [p for p in paths if p.stem.removeprefix("sec_") in only]
    return paths


def load_section(path: Path):
    spec = importlib.util.spec_from_file_location(f"servelab_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "run", None)):
        raise TypeError(f"{path.name} has no run(ctx) function")
    return module


def normalise_rows(section: str, rows, copy_gbps: float) -> list[dict]:
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise TypeError(f"section {section}: run(ctx) must return a list of dicts, got {type(rows).__name__}")
    out = []
    for row in rows:
        row = {key: row.get(key) for key in ROW_KEYS} | {k: v for k, v in row.items() if k not in ROW_KEYS}
        row["section"] = row["section"] or section
        if row["frac_copy_bw"] is None and isinstance(row["gbps"], (int, float)) and copy_gbps > 0:
            row["frac_copy_bw"] = row["gbps"] / copy_gbps
        out.append(row)
    return out


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_markdown(rows: list[dict], header_lines: list[str]) -> str:
    columns = list(ROW_KEYS) + sorted({k for r in rows for k in r} - set(ROW_KEYS))
    lines = [*header_lines, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [_fmt(row.get(c)).replace("|", "/") for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def results_rows(rows: list[dict], card: str, *, smoke: bool) -> list[dict]:
    """The table's rows in the project's one results schema (:func:`servelab.results.make_row`);
    rows without a number (a crashed section) are left out (they are in the printed table)."""
    from servelab.results import make_row

    device = "cpu" if smoke else f"cuda:{card}"
    out = []
    for row in rows:
        metric, unit, value = ("time", "ms", row.get("ms")) if row.get("ms") is not None else \
            ("copy_bandwidth", "GB/s", row.get("gbps"))
        if not isinstance(value, (int, float)):
            continue
        params = {k: v for k, v in row.items() if k not in ("section", "impl", "ms") and v is not None}
        params["card"] = card
        out.append(make_row(f"gpu-{row['section']}", str(row.get("impl") or "?"), metric, unit, float(value),
                            params=params, device=device))
    return out


def write_results(rows: list[dict], out_dir: Path | None, card: str, *, smoke: bool) -> Path | None:
    """Append the rows to the results CSV (``out_dir/results.csv`` when given); returns its path."""
    from servelab.results import append_rows

    return append_rows(results_rows(rows, card, smoke=smoke), None if out_dir is None else out_dir / "results.csv")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="dry-run the script's Python on CPU under TRITON_INTERPRET=1 at tiny sizes")
    parser.add_argument("--only", nargs="*", help="section names to run (e.g. attention sampling)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="write rows to OUT_DIR/results.csv (default bench/results/results.csv; a temp "
                             "dir with --cpu-smoke)")
    args = parser.parse_args(argv)

    # Triton decides interpreter vs GPU when kernels are imported: set it first.
    os.environ["TRITON_INTERPRET"] = "1" if args.cpu_smoke else "0"
    sys.path.insert(0, str(REPO))
    import torch

    if args.cpu_smoke:
        device, card = torch.device("cpu"), "cpu-smoke"
    else:
        if not torch.cuda.is_available():
            print("run_all.py: no CUDA device found (torch.cuda.is_available() is False). This script "
                  "times GPU kernels; use --cpu-smoke to dry-run it on CPU.", file=sys.stderr)
            return 2
        device, card = torch.device("cuda", torch.cuda.current_device()), torch.cuda.get_device_name()
    started = time.monotonic()
    copy_gbps = measure_copy_gbps(torch, device, args.cpu_smoke)
    ctx = BenchContext(device=device, copy_gbps=copy_gbps, smoke=args.cpu_smoke, card=card,
                       deadline=started + TIME_BUDGET_S)
    print(f"# {card}: copy bandwidth {copy_gbps:.1f} GB/s (read + write)", flush=True)

    rows: list[dict] = [dict.fromkeys(ROW_KEYS) | dict(section="device", case=f"copy {COPY_MIB[args.cpu_smoke]} MiB fp32",
                                                         impl="torch copy_", gbps=copy_gbps, frac_copy_bw=1.0)]
    failures = []
    for path in discover_sections(args.only):
        section = path.stem.removeprefix("sec_")
        print(f"## section {section} ({ctx.time_left():.0f}s of budget left)", flush=True)
        try:
            rows += normalise_rows(section, load_section(path).run(ctx), copy_gbps)
        except Exception as error:  # report, run the rest, exit non-zero at the end
            traceback.print_exc()
            failures.append(f"section {section} raised {type(error).__name__}: {error}")
            rows.append(dict.fromkeys(ROW_KEYS) | dict(section=section, case="(section crashed)",
                                                        check=f"FAIL {type(error).__name__}: {error}"))
    failures += [f"{r['section']} / {r['case']} / {r['impl']}: {r['check']}" for r in rows
                 if isinstance(r.get("check"), str) and r["check"].startswith("FAIL") and r["case"] != "(section crashed)"]

    elapsed = time.monotonic() - started
    header = [f"# GPU benchmarks on {card}", "",
              f"date {_dt.datetime.now().isoformat(timespec='seconds')}; torch {torch.__version__}; "
              f"copy bandwidth {copy_gbps:.1f} GB/s (read + write); total {elapsed:.0f} s",
              "vs_peer: peer time / our time (> 1: ours is faster); frac_copy_bw: gbps / copy bandwidth."]
    markdown = render_markdown(rows, header)
    out_dir = args.out_dir or (Path(tempfile.mkdtemp(prefix="servelab-smoke-")) if args.cpu_smoke else None)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = write_results(rows, out_dir, card, smoke=args.cpu_smoke)
    print(markdown)
    print(f"appended {len(rows)} rows to {csv_path}")
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
