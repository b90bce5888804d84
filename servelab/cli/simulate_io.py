"""``servelab simulate``'s inputs and outputs: which trace (a CSV file, a Mooncake / Azure file or a
shipped trace's name), which options apply to the chosen mode, and the results rows (written with
:mod:`servelab.results`, the project's one row schema).

Nothing is silently ignored: :func:`refuse_inapplicable` refuses an option the user typed that has no
effect in the chosen mode (a generator option with ``--trace``, ``--rate`` for a trace that has its own
arrival times, ``--model`` without ``--hardware`` ...), and :func:`describe_params` records only the
settings that took effect.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from servelab.results import append_rows, make_row
from servelab.scheduling.simulator import SHIPPED_TRACES, load_trace, load_trace_csv
from servelab.scheduling.simulator.traces import infer_trace_format

_UNITS = {"requests": "count", "failed": "count", "preemptions": "count", "steps": "count", "sim_s": "s",
          "wall_s": "s", "throughput_tok_s": "tok/s", "throughput_req_s": "req/s", "goodput_req_s": "req/s",
          "slo_attainment": "fraction", "prefix_hit_rate": "fraction", "mean_kv_usage": "fraction"}

# Options that shape a generated workload: they have no effect on a trace.
GENERATOR_OPTIONS = ("arrival", "burstiness", "prompt_len", "output_len", "num_prefix_groups", "prefix_len",
                     "num_clients", "client_skew", "num_priorities")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def trace_format(trace: str, given: str | None) -> str:
    """``given``, else what :func:`load_trace` infers (the shipped trace's own; .jsonl: mooncake; else csv)."""
    return given or infer_trace_format(trace)


def _csv_has_arrivals(path: str) -> bool:
    try:
        with open(path, newline="") as f:
            return "arrival_time" in next(csv.reader(f), [])
    except OSError:
        return False  # load_trace_csv reports the missing file


def applicable_options(args: Any) -> set[str]:
    """The simulate options that take effect for ``args``' mode (a generated workload or a trace)."""
    common = {"policy", "engine", "num_requests", "num_blocks", "block_size", "no_prefix_caching", "max_num_seqs",
              "max_num_batched_tokens", "max_model_len", "long_prefill_token_threshold", "ttft_slo", "tpot_slo",
              "out", "command"}
    common |= {"hardware", "model"} if args.hardware else {"cost_model"}
    if not args.trace:
        return common | set(GENERATOR_OPTIONS) | {"rate", "seed"}
    fmt = trace_format(args.trace, args.trace_format)
    common |= {"trace", "trace_format"}
    if fmt == "csv" and args.trace not in SHIPPED_TRACES:
        # token ids are drawn from --seed; --rate only spaces rows that have no arrival_time
        return common | {"seed"} | (set() if _csv_has_arrivals(args.trace) else {"rate"})
    return common | {"time_scale"}


def refuse_inapplicable(args: Any, explicit: set[str]) -> None:
    """Raise ``ValueError`` naming every option typed in ``explicit`` that has no effect in ``args``' mode."""
    if args.hardware and "cost_model" in explicit:
        raise ValueError("--hardware and --cost-model contradict each other (both set the step costs); give one")
    if args.trace in SHIPPED_TRACES and args.trace_format and args.trace_format != SHIPPED_TRACES[args.trace][1]:
        raise ValueError(f"--trace-format {args.trace_format} contradicts the shipped trace {args.trace}, which is "
                         f"{SHIPPED_TRACES[args.trace][1]}; leave --trace-format out")
    ignored = sorted(explicit - applicable_options(args))
    if "model" in ignored:
        raise ValueError("--model would have no effect and is refused: it picks the model preset of --hardware's "
                         "step costs; give --hardware too (or leave --model out)")
    if not ignored:
        return
    if not args.trace:
        why = "they apply to --trace only"
    elif trace_format(args.trace, args.trace_format) == "csv" and args.trace not in SHIPPED_TRACES:
        why = ("a CSV trace's requests come from its rows (--rate only for a CSV without an arrival_time column; "
               "--time-scale for Mooncake / Azure traces)")
    else:
        why = ("a trace's requests, arrivals and lengths come from the trace (--time-scale rescales its "
               "arrivals, --num-requests and --max-model-len cut it)")
    flags = ", ".join(_flag(d) for d in ignored)
    raise ValueError(f"{flags} would have no effect here and {'is' if len(ignored) == 1 else 'are'} refused: {why}")


def read_trace(args: Any) -> tuple[list, str]:
    """The requests of ``--trace`` (first ``--num-requests``) and a one-line description that says how
    many of the trace's requests were taken and what length cap was applied."""
    fmt = trace_format(args.trace, args.trace_format)
    if fmt == "csv" and args.trace not in SHIPPED_TRACES:
        requests = load_trace_csv(args.trace, rate=args.rate, seed=args.seed)
        clipped = 0
    else:
        requests = load_trace(args.trace, fmt, time_scale=args.time_scale, max_model_len=args.max_model_len)
        clipped = requests.num_clipped
    total = len(requests)
    requests = list(requests)[: args.num_requests]
    taken = (f"all {total} requests" if len(requests) == total else
             f"the first {len(requests)} of {total} requests (--num-requests)")
    what = f"trace {args.trace} ({fmt}, {taken}"
    if clipped:
        what += f"; {clipped} of the whole trace clipped to --max-model-len {args.max_model_len}"
    elif fmt != "csv" or args.trace in SHIPPED_TRACES:
        what += f"; lengths capped at --max-model-len {args.max_model_len}"
    return requests, what + ")"


def write_results(results: list, path: Path, params: dict) -> Path:
    """One row per policy and metric (component ``simulator``, implementation = the policy) in the
    project's results schema, appended to ``path``."""
    rows = []
    for r in results:
        for name, value in r.summary().items():
            if name == "policy" or value is None or not math.isfinite(float(value)):
                continue  # a latency of no finished request is NaN: no row (the failed count is its own row)
            unit = _UNITS.get(name, "s")
            rows.append(make_row("simulator", str(r.policy), name, unit, float(value),
                                 params={**params, "policy": str(r.policy)}))
    append_rows(rows, path)
    return path


def describe_params(args: Any) -> dict:
    """The settings that took effect (as recorded in the results rows): nothing a mode ignores."""
    keys = ("trace", "num_requests", "rate", "num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
            "max_model_len", "cost_model", "hardware", "model", "engine", "time_scale", "seed")
    applied = applicable_options(args)
    params = {k: getattr(args, k) for k in keys if k in applied and getattr(args, k, None) is not None}
    return params | {"threads": 1}


__all__ = ["GENERATOR_OPTIONS", "applicable_options", "describe_params", "read_trace", "refuse_inapplicable",
           "trace_format", "write_results"]
