"""Measured results as data: one row schema, one CSV file, for every benchmark and the CLI.

The public writer (``servelab.results``): benchmarks in ``bench/`` (through the
thin ``bench/results_io.py`` re-export) and ``servelab simulate`` / ``servelab sweep``
write their rows here, so every number the project records has one shape.

Every benchmark in ``bench/`` appends rows to ``bench/results/results.csv``
(columns :data:`COLUMNS`); ``bench/plot.py`` draws any component's rows and
renders the file as markdown. A row is one measured number::

    from servelab.results import append_rows, make_row
    append_rows([make_row("blocks", "fast", "alloc_free", "us", 1.9,
                          params={"n": 16}, p20=1.8, p50=1.9, p80=2.1)])

Columns:

- ``date``: UTC time the row was made, ISO 8601 to the second.
- ``git_sha``: ``git rev-parse --short HEAD`` of this checkout, or ``"unknown"``.
- ``component``: what was measured (``blocks``, ``scheduler``, ``sampler`` ...).
- ``implementation``: which implementation of it (``fast``, ``reference``,
  ``vllm`` ...): rows of one component differ by implementation and params.
- ``metric`` / ``unit``: the quantity and its unit (``alloc_free`` / ``us``).
- ``params``: the workload as a JSON object with sorted keys.
- ``value``: the reported number (the median where there are repeats).
- ``p20``, ``p50``, ``p80``: percentiles over repeats (empty when not measured).
- ``device``: ``cpu``, ``cuda:H100`` ...
- ``versions``: JSON object of the library versions in use (python, torch,
  triton, transformers, servelab, vllm where installed).

The file is append-only, so it holds the history: before/after comparisons
are rows with different ``git_sha``. Set ``SERVELAB_RESULTS_CSV`` to send rows
elsewhere (a scratch file for a smoke run), or to ``0`` to record nothing.
"""

from __future__ import annotations

import csv
import datetime as _dt
import functools
import json
import math
import os
import platform
import subprocess
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path

# The checkout's results file (bench/results/results.csv beside the package); set
# $SERVELAB_RESULTS_CSV to write elsewhere (an installed package has no bench/ folder).
RESULTS_CSV = Path(__file__).resolve().parents[1] / "bench" / "results" / "results.csv"
COLUMNS = ("date", "git_sha", "component", "implementation", "metric", "unit", "params", "value",
           "p20", "p50", "p80", "device", "versions")
NUMERIC = ("value", "p20", "p50", "p80")
ENV_PATH = "SERVELAB_RESULTS_CSV"
_VERSIONED = ("torch", "triton", "transformers", "servelab", "vllm")


@functools.lru_cache(maxsize=1)
def git_sha() -> str:
    """Short sha of this checkout's HEAD, ``"unknown"`` outside git."""
    try:
        proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = proc.stdout.strip()
    return sha if proc.returncode == 0 and sha else "unknown"


@functools.lru_cache(maxsize=1)
def library_versions() -> str:
    """JSON object of versions: python always, each of torch, triton,
    transformers, servelab, vllm where installed (read from package metadata,
    so nothing heavy is imported)."""
    versions = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return json.dumps(versions, sort_keys=True)


def _check_text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _check_number(name: str, value: object, *, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        what = "a finite number or None" if optional else "a finite number"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(f"{float(value):.6g}")  # 6 significant digits: timings are not more precise


def make_row(component: str, implementation: str, metric: str, unit: str, value: float, *,
             params: Mapping[str, object] | None = None, p20: float | None = None,
             p50: float | None = None, p80: float | None = None, device: str = "cpu",
             extra_versions: Mapping[str, str] | None = None) -> dict:
    """One validated result row (a dict keyed by :data:`COLUMNS`).

    ``params`` must be JSON-serialisable (it is stored as JSON with sorted
    keys); numbers must be finite. ``date``, ``git_sha`` and ``versions`` are
    filled in here; ``extra_versions`` adds or overrides entries of
    ``versions`` (e.g. the vLLM version of another interpreter that produced
    the number). Raises ``ValueError`` naming the bad argument.
    """
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a mapping (JSON object) or None, got {params!r}")
    try:
        params_json = json.dumps(dict(params), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"params must be JSON-serialisable, got {params!r}: {exc}") from None
    row = {
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "git_sha": git_sha(),
        "component": _check_text("component", component),
        "implementation": _check_text("implementation", implementation),
        "metric": _check_text("metric", metric),
        "unit": _check_text("unit", unit),
        "params": params_json,
        "value": _check_number("value", value, optional=False),
        "device": _check_text("device", device),
        "versions": library_versions(),
    }
    if extra_versions:
        row["versions"] = json.dumps({**json.loads(row["versions"]), **dict(extra_versions)}, sort_keys=True)
    for name, q in (("p20", p20), ("p50", p50), ("p80", p80)):
        row[name] = _check_number(name, q, optional=True)
    return {c: row[c] for c in COLUMNS}


def percentiles(samples: Iterable[float]) -> dict[str, float]:
    """``{"p20", "p50", "p80"}`` of ``samples`` (linear interpolation between
    order statistics, like ``numpy.percentile``'s default). One sample gives
    it three times; no samples raises ``ValueError``."""
    data = sorted(float(x) for x in samples)
    if not data:
        raise ValueError("percentiles needs at least one sample, got none")

    def q(p: float) -> float:
        pos = p * (len(data) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(data) - 1)
        return data[lo] + (data[hi] - data[lo]) * (pos - lo)

    return {"p20": q(0.2), "p50": q(0.5), "p80": q(0.8)}


def versions_of_python(python: str, packages: Iterable[str] = ("vllm", "torch")) -> dict[str, str]:
    """Versions of ``packages`` installed for another interpreter (for rows
    measured in a subprocess); ``{}`` when that interpreter cannot be run."""
    code = ("import json; from importlib import metadata as m\nout = {}\n"
            f"for p in {list(packages)!r}:\n"
            "    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        return json.loads(proc.stdout) if proc.returncode == 0 else {}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


def resolve_path(path: str | os.PathLike | None = None) -> Path | None:
    """``path``, else ``$SERVELAB_RESULTS_CSV``, else :data:`RESULTS_CSV`;
    ``None`` when the variable is ``0`` (recording switched off)."""
    if path is not None:
        return Path(path)
    env = os.environ.get(ENV_PATH)
    if env == "0":
        return None
    return Path(env) if env else RESULTS_CSV


def _complete(row: Mapping[str, object], index: int) -> dict:
    if not isinstance(row, Mapping):
        raise ValueError(f"rows[{index}] must be a dict made by make_row, got {type(row).__name__}")
    missing = [c for c in COLUMNS if c not in row and c not in ("git_sha", "versions", "date")]
    if missing:
        raise ValueError(f"rows[{index}] lacks columns {missing}; build rows with make_row")
    extra = sorted(set(row) - set(COLUMNS))
    if extra:
        raise ValueError(f"rows[{index}] has unknown columns {extra}; valid: {list(COLUMNS)}")
    full = dict(row)
    full.setdefault("git_sha", git_sha())
    full.setdefault("versions", library_versions())
    full.setdefault("date", _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat())
    return full


def check_results_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is fresh (missing or empty: the header will be written); raises
    ``ValueError`` when it exists with a header other than :data:`COLUMNS` (so a
    command can refuse it before its run, not after)."""
    target = Path(path)
    if not target.exists() or target.stat().st_size == 0:
        return True
    with target.open(newline="") as fh:
        header = next(csv.reader(fh), [])
    if tuple(header) != COLUMNS:
        raise ValueError(f"{target} has header {header}, expected {list(COLUMNS)}")
    return False


def append_rows(rows: Iterable[Mapping[str, object]], path: str | os.PathLike | None = None) -> Path | None:
    """Append ``rows`` (from :func:`make_row`) to the results CSV; returns its path.

    ``path`` defaults to :data:`RESULTS_CSV` (or ``$SERVELAB_RESULTS_CSV``;
    nothing is written and ``None`` is returned when that is ``0``). The file
    and its folder are created with the header when missing. All rows are
    checked before anything is written, so a bad row appends nothing; a file
    whose header is not :data:`COLUMNS` raises ``ValueError``.
    """
    target = resolve_path(path)
    rows = [_complete(r, i) for i, r in enumerate(rows)]
    if target is None:
        return None
    fresh = check_results_file(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        if fresh:
            writer.writeheader()
        for row in rows:
            writer.writerow({c: "" if row[c] is None else row[c] for c in COLUMNS})
    return target


def read_rows(path: str | os.PathLike | None = None, component: str | None = None) -> list[dict]:
    """Rows of the results CSV (all, or one ``component``'s), oldest first.

    Numbers come back as ``float`` (``None`` where empty), ``params`` and
    ``versions`` as dicts. A missing file gives ``[]``.
    """
    target = resolve_path(path) or RESULTS_CSV
    if not target.exists():
        return []
    out = []
    with target.open(newline="") as fh:
        for row in csv.DictReader(fh):
            if component is not None and row["component"] != component:
                continue
            for name in NUMERIC:
                row[name] = float(row[name]) if row[name] not in ("", None) else None
            for name in ("params", "versions"):
                row[name] = json.loads(row[name]) if row[name] else {}
            out.append(row)
    return out
