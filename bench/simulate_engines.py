"""The same 10,000-request trace through servelab's scheduler and vLLM's real scheduler.

Usage (in an environment where vLLM imports, e.g. ``bash ci/vllm-cpu/setup.sh VENV``)::

    VENV/bin/python bench/simulate_engines.py [--num-requests 10000] [--policy fcfs,sjf,vtc]
    VENV/bin/python bench/simulate_engines.py --num-requests 300 --no-record      # smoke run

The workload is bench/bench_simulator.py's (lognormal prompts around 512 tokens
and outputs around 128, Poisson arrivals at 8/s, 8 shared 256-token system
prompts, 4 clients, 3 priorities; 4096 KV blocks of 16 tokens; default cost
model). Each policy runs on both engines (``servelab simulate --engine
servelab|vllm``): vLLM's engine runs the policy bridged into vLLM's
``Scheduler`` (``servelab.integrations.vllm.make_scheduler_cls``); ``vllm-fcfs``
is vLLM's own FCFS. Prints the report table of each run and the wall time of
each simulation, and appends rows to bench/results/results.csv (component
``simulator``, implementation = engine; metrics ``wall_s``, ``ttft_p50_s``,
``ttft_p99_s``, ``tpot_p50_s``, ``throughput_tok_s``, ``preemptions``,
``prefix_hit_rate``; params name the policy and the workload).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

METRICS = (("wall_s", "s"), ("ttft_p50", "s"), ("ttft_p99", "s"), ("tpot_p50", "s"), ("throughput_tok_s", "tok/s"),
           ("preemptions", "count"), ("prefix_hit_rate", "fraction"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--policy", default="fcfs,sjf,vtc")
    parser.add_argument("--engines", default="servelab,vllm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/results/results.csv")
    args = parser.parse_args()

    from servelab.scheduling.simulator import WorkloadSpec, format_table, generate_workload, simulate

    spec = WorkloadSpec(num_requests=args.num_requests, rate=args.rate, num_prefix_groups=8, prefix_len=256,
                        num_clients=4, num_priorities=3, seed=args.seed)
    requests = generate_workload(spec)
    params = {"num_requests": args.num_requests, "rate": args.rate, "prefix_groups": 8, "prefix_len": 256,
              "clients": 4, "num_blocks": 4096, "block_size": 16, "seed": args.seed}
    results, rows = [], []
    print(f"{'engine':<10}{'policy':<12}{'simulate s':>12}{'steps':>9}{'steps/s':>10}")
    for engine in args.engines.split(","):
        for policy in args.policy.split(","):
            if policy.startswith("vllm-") and engine != "vllm":
                continue
            t = time.perf_counter()
            r = simulate(requests, policy, engine=engine)
            total = time.perf_counter() - t
            results.append(r)
            print(f"{engine:<10}{policy:<12}{total:>12.2f}{r.num_steps:>9}{r.num_steps / r.wall_s:>10.0f}", flush=True)
            summary = dict(r.summary(), wall_s=total)
            rows.append((engine, policy, summary))
    print()
    print(format_table(results))
    if not args.no_record:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from results_io import append_rows, make_row

        out = [make_row("simulator", engine, metric, unit, float(summary[metric]), params=dict(params, policy=policy))
               for engine, policy, summary in rows for metric, unit in METRICS]
        print(f"\nresults: {append_rows(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
