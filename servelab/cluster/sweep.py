"""Sweeps: a grid of cluster simulations, in local processes or on Ray.

A sweep spec (TOML, or the same dict in Python)::

    [workload]                 # a generated WorkloadSpec ...
    num_requests = 200
    rate = 20.0
    prompt_len = "lognormal:256:0.6"
    num_prefix_groups = 8
    prefix_len = 512
    # ... or a real trace:  trace = "mooncake_conversation", time_scale = 2.0,
    #                        max_requests = 500, max_model_len = 32768, max_tokens_cap = 64

    [cluster]                  # fixed simulate_cluster options
    num_blocks = 2048
    max_num_seqs = 128         # SchedulerConfig fields are accepted here too

    [grid]                     # every combination is one run
    router = ["round_robin", "prefix_affinity"]
    replicas = [2, 4]
    rate = [10.0, 20.0]        # workload keys may be swept too
    seed = [0, 1]
    # P/D: prefill_replicas / decode_replicas / kv_bandwidth_gbps / kv_latency_s

A grid point is a flat dict; :func:`run_point` (a plain, picklable function:
the same task on every executor) turns it into one ``simulate_cluster`` run
and returns its summary. :func:`run_sweep` runs all points with
``executor="local"`` (a process pool, ``jobs`` processes) or ``"ray"``
(``ray.remote(run_point)``; ``address`` is passed to ``ray.init``: ``"auto"``
for a running cluster, ``"ray://head:10001"`` for a remote one, None for a
local instance). Rows go to the results CSV (``servelab.results``, component
``cluster``), and :func:`plot_sweep` draws TTFT p90 and hit rate per point.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from servelab.cluster.pd import PD
from servelab.cluster.simulator import simulate_cluster
from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.simulator.cost_model import StepCostModel
from servelab.scheduling.simulator.traces import load_trace
from servelab.scheduling.simulator.workload import LengthDist, WorkloadSpec

__all__ = ["EXECUTORS", "expand_grid", "iter_sweep", "load_spec", "plot_sweep", "run_point", "run_sweep", "sweep_rows"]

EXECUTORS = ("local", "ray")
_WORKLOAD_KEYS = {f.name for f in dataclasses.fields(WorkloadSpec)}
_TRACE_KEYS = {"trace", "trace_format", "time_scale", "max_requests", "max_model_len", "max_tokens_cap"}
_PD_KEYS = {"prefill_replicas", "decode_replicas", "kv_bandwidth_gbps", "kv_latency_s"}
_CONFIG_KEYS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_CLUSTER_KEYS = {"replicas", "router", "policy", "num_blocks", "block_size", "enable_prefix_caching", "watermark",
                 "ttft_slo_s", "tpot_slo_s", "num_layers", "cost_model"}
_SECTIONS = ("workload", "cluster", "grid")


def load_spec(path: str | os.PathLike) -> dict[str, Any]:
    """Read a TOML sweep spec; ``ValueError`` naming the file for a syntax error."""
    import tomllib

    try:
        with open(path, "rb") as f:
            spec = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"sweep spec {str(path)!r} is not valid TOML: {exc}") from None
    return spec


def expand_grid(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every grid point: the workload and cluster sections overlaid with one
    combination of the grid's values (in the grid's key order). Unknown keys
    raise ``ValueError`` naming them and the valid ones."""
    unknown_sections = set(spec) - set(_SECTIONS)
    if unknown_sections:
        raise ValueError(f"sweep spec has unknown sections {sorted(unknown_sections)}; valid: {list(_SECTIONS)}")
    if not any(spec.get(section) for section in _SECTIONS):
        raise ValueError("sweep spec is empty: it needs a [workload] (or a trace), a [cluster] or a [grid] "
                         "table; nothing is run on defaults the spec did not ask for")
    base: dict[str, Any] = {}
    for section in ("workload", "cluster"):
        values = spec.get(section, {})
        if not isinstance(values, Mapping):
            raise ValueError(f"[{section}] must be a table of key = value, got {values!r}")
        base.update(values)
    grid = spec.get("grid", {})
    if not isinstance(grid, Mapping):
        raise ValueError(f"[grid] must be a table of key = [values], got {grid!r}")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"grid.{key} must be a non-empty list of values, got {values!r}")
    points = [{**base, **dict(zip(grid, combo))} for combo in itertools.product(*grid.values())]
    valid = _WORKLOAD_KEYS | _TRACE_KEYS | _PD_KEYS | _CONFIG_KEYS | _CLUSTER_KEYS
    for point in points[:1]:
        bad = sorted(set(point) - valid)
        if bad:
            raise ValueError(f"sweep spec keys {bad} are unknown; valid: {sorted(valid)}")
        # nothing silently ignored: a trace brings its own requests; the trace keys need a trace
        trace_only = _TRACE_KEYS - _CONFIG_KEYS  # max_model_len is also a scheduler setting
        unused = sorted(set(point) & _WORKLOAD_KEYS) if "trace" in point else sorted(set(point) & trace_only)
        if unused:
            why = ("a trace brings its own requests (trace keys: " + ", ".join(sorted(_TRACE_KEYS)) + ")"
                   if "trace" in point else "they apply to a trace only (set trace = NAME or PATH)")
            raise ValueError(f"sweep spec keys {unused} would have no effect and are refused: {why}")
    return points


def _workload(point: Mapping[str, Any]):
    if "trace" in point:
        requests = load_trace(point["trace"], format=point.get("trace_format"),
                              time_scale=point.get("time_scale", 1.0), max_model_len=point.get("max_model_len"))
        if "max_requests" in point:
            requests = requests[: point["max_requests"]]
        if "max_tokens_cap" in point:
            cap = point["max_tokens_cap"]
            requests = [dataclasses.replace(r, max_tokens=min(r.max_tokens, cap)) for r in requests]
        return requests
    kwargs = {k: v for k, v in point.items() if k in _WORKLOAD_KEYS}
    for key in ("prompt_len", "output_len"):
        if isinstance(kwargs.get(key), (str, int)):
            kwargs[key] = LengthDist.parse(str(kwargs[key]))
    for key in ("client_weights", "client_length_scale"):
        if key in kwargs:
            kwargs[key] = tuple(kwargs[key])
    return WorkloadSpec(**kwargs)


def run_point(point: Mapping[str, Any]) -> dict[str, Any]:
    """One grid point -> one ``simulate_cluster`` run -> its flat summary
    (the point's own keys included). The task every executor runs."""
    point = dict(point)
    pd_args = {k: point[k] for k in _PD_KEYS if k in point}
    pd = PD(**pd_args) if pd_args else None
    config = {k: point[k] for k in _CONFIG_KEYS if k in point}
    config.setdefault("max_num_batched_tokens", 2048)
    config.setdefault("max_num_seqs", 256)
    config.setdefault("max_model_len", point.get("max_model_len", 8192))
    cost = point.get("cost_model")
    kwargs = {k: point[k] for k in _CLUSTER_KEYS - {"replicas", "router", "cost_model"} if k in point}
    result = simulate_cluster(_workload(point), None if pd else point.get("replicas", 1),
                              point.get("router", "round_robin"), pd=pd, scheduler_config=SchedulerConfig(**config),
                              cost_model=StepCostModel(*cost) if cost else None, **kwargs)
    row = {f"point.{k}": v for k, v in point.items()}
    row.update(result.summary())
    return row


def run_sweep(points: Sequence[Mapping[str, Any]], executor: str = "local", *, jobs: int | None = None,
              address: str | None = None, task: Callable[[Mapping[str, Any]], dict] = run_point) -> list[dict]:
    """Run ``task`` on every point; results in the points' order.

    ``executor="local"``: a process pool of ``jobs`` processes (default: the
    CPU count, at most the number of points; ``jobs=1`` runs in this process).
    ``executor="ray"``: one Ray task per point (``ray.init(address=address)``
    unless Ray is already initialised); needs the ``ray`` extra. To keep each
    point as it finishes (and what finished before a Ctrl-C), iterate
    :func:`iter_sweep` instead.
    """
    results: dict[int, dict] = dict(iter_sweep(points, executor, jobs=jobs, address=address, task=task))
    return [results[i] for i in range(len(points))]


def iter_sweep(points: Sequence[Mapping[str, Any]], executor: str = "local", *, jobs: int | None = None,
               address: str | None = None,
               task: Callable[[Mapping[str, Any]], dict] = run_point) -> Iterator[tuple[int, dict]]:
    """Yield ``(index into points, result)`` as each point finishes (completion order).

    The same executors as :func:`run_sweep`. Closing the iterator early (or a
    ``KeyboardInterrupt`` while it waits) cancels the points not started; what
    was yielded before is the caller's to keep.

    Raises ``ValueError`` for an unknown executor, ``address`` without Ray, a
    bad ``jobs``, or a Ray ``address`` where no cluster answers.
    """
    if executor not in EXECUTORS:
        raise ValueError(f"executor={executor!r} is invalid; valid: {', '.join(EXECUTORS)}")
    if executor != "ray" and address is not None:
        raise ValueError("address applies to executor='ray' only")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs={jobs!r} is invalid; valid: None or an int >= 1")
    if not points:
        return
    if executor == "ray":
        yield from _iter_on_ray(points, address, task)
        return
    jobs = min(jobs or os.cpu_count() or 1, len(points))
    if jobs == 1:
        for i, p in enumerate(points):
            yield i, task(p)
        return
    pool = ProcessPoolExecutor(max_workers=jobs)
    try:
        futures = {pool.submit(task, p): i for i, p in enumerate(points)}
        for future in as_completed(futures):
            yield futures[future], future.result()
    finally:
        # Ctrl-C or an early close: drop the points not started, do not wait for the pool's
        # workers (they get the same SIGINT from the terminal).
        pool.shutdown(wait=False, cancel_futures=True)


def _ray_init(ray: Any, address: str | None) -> None:
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, TimeoutError) as exc:
        raise ValueError(f"address={address!r}: no Ray cluster answers there ({' '.join(str(exc).split())[:200]}); "
                         "start one (`ray start --head`) or leave the address out to start a local Ray "
                         "instance") from None
    except (ImportError, ValueError) as exc:
        if "client" not in str(exc):
            raise ValueError(f"address={address!r}: {' '.join(str(exc).split())[:200]}") from None
        # ray://HOST:PORT needs the Ray client (grpcio): the ray extra installs ray[client].
        raise ImportError(f"address={address!r} needs the Ray client: pip install 'servelab[ray]' (it installs "
                          "ray[client])") from None
    except RuntimeError as exc:
        raise ValueError(f"address={address!r}: Ray could not connect "
                         f"({' '.join(str(exc).split())[:200]})") from None


def _iter_on_ray(points: Sequence[Mapping[str, Any]], address: str | None,
                 task: Callable[[Mapping[str, Any]], dict]) -> Iterator[tuple[int, dict]]:
    try:
        import ray
    except ImportError:
        raise ImportError("the ray executor needs Ray: pip install 'servelab[ray]'") from None
    _ray_init(ray, address)
    remote = ray.remote(task)
    pending = {remote.remote(dict(p)): i for i, p in enumerate(points)}
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                yield pending.pop(ref), ray.get(ref)
    finally:
        for ref in pending:
            ray.cancel(ref)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def sweep_rows(results: Sequence[Mapping[str, Any]], name: str = "sweep") -> list[dict]:
    """Rows for ``servelab.results`` (component ``cluster``, implementation =
    the router): TTFT p50/p90, TPOT p90, e2e p90, goodput, hit rate and
    imbalance of each run, its grid point as ``params``."""
    from servelab.results import make_row

    metrics = (("ttft_p50", "s"), ("ttft_p90", "s"), ("tpot_p90", "s"), ("e2e_p90", "s"),
               ("goodput_req_s", "req/s"), ("throughput_tok_s", "tok/s"), ("prefix_hit_rate", "fraction"),
               ("imbalance", "max/mean"))
    rows = []
    for res in results:
        params = {k.removeprefix("point."): v for k, v in res.items() if k.startswith("point.")}
        params["sweep"] = name
        for metric, unit in metrics:
            if _finite(res.get(metric)):
                rows.append(make_row("cluster", str(res["router"]), metric, unit, float(res[metric]),
                                     params=params))
    return rows


def plot_sweep(results: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str = "") -> Path:
    """TTFT p90 and prefix hit rate of every run, one bar per grid point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [", ".join(f"{k.removeprefix('point.')}={v}" for k, v in r.items()
                        if k.startswith("point.") and k.removeprefix("point.") in _varying(results)) or "run"
              for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.5 * len(results) + 4), 4.5))
    for ax, metric, ylabel in ((axes[0], "ttft_p90", "TTFT p90 (s)"), (axes[1], "prefix_hit_rate", "hit rate")):
        ax.bar(range(len(results)), [r.get(metric, math.nan) for r in results])
        ax.set_xticks(range(len(results)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
    fig.suptitle(title or "servelab sweep")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _varying(results: Sequence[Mapping[str, Any]]) -> set[str]:
    keys = {k for r in results for k in r if k.startswith("point.")}
    return {k.removeprefix("point.") for k in keys if len({repr(r.get(k)) for r in results}) > 1}
