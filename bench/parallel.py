"""Parallel study: TP/PP step time split into compute and communication; real-engine DP vs the simulator.

Two parts (``--part``), each appending rows to ``bench/results/results.csv``:

- ``grid`` (component ``parallel``): the tiny model (or ``--model smollm2``) serving the
  same greedy batch in one process (``tp1``), with ``tensor_parallel_size=2`` (``tp2``) and
  ``pipeline_parallel_size=2`` (``pp2``) on ``multiproc`` workers. Per configuration:
  the wall time per step seen by the driver (``step_ms``), and from the workers' own clocks
  the time per step inside ``execute`` spent in collectives / point-to-point transfers
  (``comm_ms``: the slowest rank's) and the rest (``compute_ms``); ``driver_overhead_ms``
  is ``step_ms`` minus the slowest rank's ``execute`` (pickling, pipes, the scheduler).
  On this CPU the ranks share 2 cores with everything else, so TP here measures
  communication cost, not speed-up: the params record ``os.getloadavg()``.
- ``dp`` (component ``parallel_dp``): the first ``--num-requests`` requests of the shipped
  Mooncake conversation trace, scaled to 8-token blocks (``scaled_block_trace``: block
  sharing kept exactly), on ``--replicas`` tiny-model replicas (:class:`servelab.cluster.replicas.Replicas`)
  behind each router, and the simulator's prediction for the same replicas, pool, scheduler
  limits and requests (``implementation`` ``real`` / ``sim``, metric ``prefix_hit_rate``; each
  row's ``routed`` is its own system's requests per replica). Two
  admission modes: ``sequential`` (one request in the cluster at a time, the simulator fed
  arrivals 1000 s apart: both deterministic) and ``open`` (arrivals every
  ``latency / --in-flight`` seconds, each system at its own sequential per-request
  latency: the same offered load relative to its own service rate, real wall clock for
  the replicas, simulated time for the simulator).

Usage::

    python bench/parallel.py --part grid --threads 1
    python bench/parallel.py --part dp --num-requests 1000 --num-blocks 1200 --replicas 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import append_rows, make_row  # noqa: E402

from servelab import Pipeline, SamplingParams  # noqa: E402

GRID = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "tp3": {"tensor_parallel_size": 3},
        "pp2": {"pipeline_parallel_size": 2}}
ROUTERS = ("round_robin", "prefix_affinity", "consistent_hash")
#: prefix_affinity's absolute balance slack scaled like the trace (8192 tokens at 512-token blocks)
AFFINITY_KWARGS = {"balance_abs_tokens": 128}
#: the dp replicas' max_model_len (the simulator is given the same)
MAX_MODEL_LEN = 2048


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _model_path(name: str) -> Path:
    if name == "smollm2":
        from servelab.models.hub import fetch_smollm2

        return Path(fetch_smollm2())
    from servelab.models import build_tiny_model

    return build_tiny_model(Path(tempfile.gettempdir()) / "servelab-bench-parallel-tiny", max_position_embeddings=2048,
                            hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=32, num_hidden_layers=4)


def _measure(pipe: Pipeline, prompts: list[str], params: SamplingParams) -> tuple[dict[str, float], list]:
    """One timed ``generate``: per-step wall, communication and compute (ms), and the tokens."""
    before = pipe.executor.comm_stats()
    start = time.perf_counter()
    outs = pipe.generate(prompts, params)
    wall = time.perf_counter() - start
    after = pipe.executor.comm_stats()
    steps = pipe.last_run_metrics.num_steps
    values = {"step_ms": 1e3 * wall / steps, "steps": float(steps)}
    if after:
        comm = max((a["comm_s"] - b["comm_s"]) for a, b in zip(after, before))
        execute = max((a["comm_s"] + a["compute_s"] - b["comm_s"] - b["compute_s"]) for a, b in zip(after, before))
        values.update(comm_ms=1e3 * comm / steps, compute_ms=1e3 * (execute - comm) / steps,
                      driver_overhead_ms=values["step_ms"] - 1e3 * execute / steps)
    return values, [o.token_ids for o in outs]


def run_grid(args: argparse.Namespace) -> list[dict]:
    """Every configuration built once, then measured in interleaved rounds (medians reported)."""
    path = _model_path(args.model)
    prompts = [f"Request {i}: the block table maps every token of the prompt to a page" for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    names = args.configs.split(",")
    pipes = {name: Pipeline.from_pretrained(path, **GRID[name]) for name in names}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    tokens: dict[str, list] = {}
    loads = []
    try:
        for pipe in pipes.values():
            pipe.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm (kernels, packing)
        for _ in range(args.repeats):
            for name in names:
                loads.append(_load())
                values, tokens[name] = _measure(pipes[name], prompts, params)
                samples[name].append(values)
    finally:
        for pipe in pipes.values():
            pipe.close()
    rows = []
    for name in names:
        same = tokens[name] == tokens[names[0]]
        base = {"model": args.model, "batch": args.batch, "max_tokens": args.max_tokens, "repeats": args.repeats,
                "loadavg_min": min(loads), "loadavg_max": max(loads), "token_identical_to_first": same,
                "threads_per_rank": 1, "configs": names}
        medians = {k: statistics.median(v[k] for v in samples[name]) for k in samples[name][0] if k != "steps"}
        for metric, value in medians.items():
            rows.append(make_row("parallel", name, metric, "ms", value, params=base))
        print(name, {k: round(v, 3) for k, v in medians.items()}, "identical" if same else "DIFFERENT",
              f"load {min(loads)}-{max(loads)}")
    return rows


def _dp_requests(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    from servelab.cluster.replicas import scaled_block_trace
    from servelab.scheduling.simulator.traces import load_trace

    trace = load_trace("mooncake_conversation")[: args.num_requests]
    requests = scaled_block_trace(trace, tokens_per_block=8, source_block=512, vocab_size=512, max_tokens=2)
    return [(p, m) for p, m in requests if len(p) + m <= min(2000, (args.num_blocks - 2) * 8)]


def _simulate(requests: list, router: str, args: argparse.Namespace, gap_s: float) -> tuple[float, float, list[int]]:
    """(predicted hit rate, mean request latency in simulated seconds, requests per replica)."""
    from servelab.cluster import simulate_cluster
    from servelab.cluster.replicas import sequential_arrivals
    from servelab.scheduling.config import SchedulerConfig

    kwargs = AFFINITY_KWARGS if router == "prefix_affinity" else None
    # The replicas' scheduler limits and pool: max_model_len as given to them, no admission watermark.
    result = simulate_cluster(sequential_arrivals(requests, gap_s), replicas=args.replicas, router=router,
                              num_blocks=args.num_blocks, block_size=8, router_kwargs=kwargs, watermark=0.0,
                              scheduler_config=SchedulerConfig(max_model_len=MAX_MODEL_LEN))
    spans = [m.finish_time - m.arrival_time for m in result.cluster.requests if m.finish_time is not None]
    return float(result.summary()["prefix_hit_rate"]), sum(spans) / max(1, len(spans)), list(result.routed)


def run_dp(args: argparse.Namespace) -> list[dict]:
    from servelab.cluster.replicas import Replicas
    from servelab.models import build_tiny_model

    requests = _dp_requests(args)
    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    folder = Path(tempfile.gettempdir()) / "servelab-bench-parallel-dp-tiny"
    path = build_tiny_model(folder, max_position_embeddings=2048)
    rows = []
    base = {"trace": "mooncake_conversation", "num_requests": len(requests), "replicas": args.replicas,
            "num_blocks": args.num_blocks, "block_size": 8, "tokens_per_source_block": 8}
    settings = {"num_blocks": args.num_blocks, "block_size": 8, "max_model_len": MAX_MODEL_LEN}
    with Replicas(path, args.replicas, **settings) as reps:
        for router in args.routers.split(","):
            kwargs = AFFINITY_KWARGS if router == "prefix_affinity" else None
            predicted, sim_latency, predicted_routed = _simulate(requests, router, args, 1000.0)
            real_latency = 0.0
            for mode in ("sequential", "open") if args.in_flight > 1 else ("sequential",):
                reps.reset_prefix_caches()
                load = _load()
                if mode == "sequential":
                    run = reps.run(prompts, params, router=router, max_in_flight=1, router_kwargs=kwargs)
                    real_latency, sim_rate, sim_routed = run.wall_s / len(prompts), predicted, predicted_routed
                else:  # both open loops offered in_flight x their own sequential service rate
                    gap = real_latency / args.in_flight
                    run = reps.run(prompts, params, router=router, router_kwargs=kwargs,
                                   arrival_times=[i * gap for i in range(len(prompts))])
                    sim_rate, _, sim_routed = _simulate(requests, router, args, sim_latency / args.in_flight)
                params_row = {**base, "router": router, "mode": mode, "offered_load": 1 if mode == "sequential"
                              else args.in_flight, "loadavg": load, "failed": run.num_failed, "routed": run.routed}
                rows.append(make_row("parallel_dp", "real", "prefix_hit_rate", "ratio", run.prefix_hit_rate,
                                     params=params_row))
                rows.append(make_row("parallel_dp", "sim", "prefix_hit_rate", "ratio", sim_rate,
                                     params={**params_row, "routed": sim_routed}))
                print(f"{router:16s} {mode:10s} real {run.prefix_hit_rate:.4f} sim {sim_rate:.4f} routed real "
                      f"{run.routed} sim {sim_routed} failed {run.num_failed} wall {run.wall_s:.1f}s load {load}",
                      flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("grid", "dp"), required=True)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--configs", default="tp1,tp2,pp2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the driver (tp1)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--num-blocks", type=int, default=1200)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--in-flight", type=int, default=8, help="offered load of the open mode (x service rate)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rows = run_grid(args) if args.part == "grid" else run_dp(args)
    if not args.no_write:
        print("appended to", append_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
