"""``servelab simulate``'s inputs and outputs: which trace (a CSV file, a Mooncake / Azure file or a
shipped trace's name) and the results rows (written with :mod:`servelab.results`, the project's one
row schema)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.results import append_rows, make_row
from servelab.scheduling.simulator import SHIPPED_TRACES, load_trace, load_trace_csv

_UNITS = {"requests": "count", "failed": "count", "preemptions": "count", "steps": "count", "sim_s": "s",
          "wall_s": "s", "throughput_tok_s": "tok/s", "throughput_req_s": "req/s", "goodput_req_s": "req/s",
          "slo_attainment": "fraction", "prefix_hit_rate": "fraction", "mean_kv_usage": "fraction"}


def trace_format(trace: str, given: str | None) -> str:
    """``given``, else the shipped trace's own, else from the suffix (.jsonl: mooncake; else csv)."""
    if given:
        return given
    if trace in SHIPPED_TRACES:
        return SHIPPED_TRACES[trace][1]
    return "mooncake" if trace.endswith(".jsonl") else "csv"


def read_trace(args: Any) -> tuple[list, str]:
    """The requests of ``--trace`` (first ``--num-requests``) and a one-line description."""
    fmt = trace_format(args.trace, args.trace_format)
    if fmt == "csv" and args.trace not in SHIPPED_TRACES:
        requests = load_trace_csv(args.trace, rate=args.rate, seed=args.seed)
        clipped = 0
    else:
        requests = load_trace(args.trace, fmt, time_scale=args.time_scale, max_model_len=args.max_model_len)
        clipped = requests.num_clipped
    requests = list(requests)[: args.num_requests]
    what = f"trace {args.trace} ({fmt}, {len(requests)} requests"
    if clipped:
        what += f"; {clipped} of the whole trace clipped to --max-model-len {args.max_model_len}"
    return requests, what + ")"


def write_results(results: list, path: Path, params: dict) -> Path:
    """One row per policy and metric (component ``simulator``, implementation = the policy) in the
    project's results schema, appended to ``path``."""
    rows = []
    for r in results:
        for name, value in r.summary().items():
            if name == "policy" or value is None:
                continue
            unit = _UNITS.get(name, "s")
            rows.append(make_row("simulator", str(r.policy), name, unit, float(value),
                                 params={**params, "policy": str(r.policy)}))
    append_rows(rows, path)
    return path


def describe_params(args: Any) -> dict:
    keys = ("trace", "num_requests", "rate", "num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
            "max_model_len", "cost_model", "hardware", "model", "engine", "time_scale")
    params = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None} | {"threads": 1}
    if "hardware" in params:
        params.pop("cost_model", None)
    else:
        params.pop("model", None)
    return params


__all__ = ["describe_params", "read_trace", "trace_format", "write_results"]
