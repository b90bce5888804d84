"""Simulator speed: a large trace through the real scheduler and KV manager, timed.

Usage::

    taskset -c 0 python bench/bench_simulator.py [--num-requests 100000] [--rate 80] [--policy fcfs]
    taskset -c 0 python bench/bench_simulator.py --num-requests 2000 --no-record     # smoke run

The workload: lognormal prompts around 512 tokens and outputs around 128 (the
CLI's defaults), Poisson arrivals at ``--rate`` (80/s overloads the default
engine: requests queue), 8 shared 256-token system prompts, 4 clients, 3
priorities; 4096 KV blocks of 16 tokens, prefix caching on. Per policy it
prints the wall time of the whole ``simulate`` call and of its loop, the CPU
time of the process, simulated requests per second and microseconds per
simulated step, and appends them to ``bench/results/results.csv`` (component
``simulator``; ``params`` hold the workload and ``threads=1``). Targets: 100k
requests in < 30 s on one core, 1M in < 5 min.

The machine may be shared: CPU time (``cpu_s``) is what one core spent, the
wall time also counts waiting for the core.
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=80.0)
    parser.add_argument("--policy", default="fcfs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true", help="do not append rows to results.csv")
    args = parser.parse_args()

    import torch

    from servelab.scheduling.simulator import WorkloadSpec, format_table, generate_workload, simulate

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    spec = WorkloadSpec(num_requests=args.num_requests, rate=args.rate, num_prefix_groups=8, prefix_len=256,
                        num_clients=4, num_priorities=3, seed=args.seed)
    requests = generate_workload(spec)
    print(f"workload: {args.num_requests} requests at {args.rate}/s generated in {time.perf_counter() - t0:.2f} s")
    results, rows = [], []
    print(f"{'policy':<10}{'simulate s':>12}{'loop s':>9}{'cpu s':>9}{'steps':>9}{'req/s':>9}{'us/step':>9}")
    for policy in args.policy.split(","):
        t, c = time.perf_counter(), time.process_time()
        r = simulate(requests, policy)
        total, cpu = time.perf_counter() - t, time.process_time() - c
        results.append(r)
        print(f"{policy:<10}{total:>12.2f}{r.wall_s:>9.2f}{cpu:>9.2f}{r.num_steps:>9}"
              f"{args.num_requests / total:>9.0f}{total / r.num_steps * 1e6:>9.1f}")
        rows.append((policy, total, cpu, r))
    print()
    print(format_table(results))
    if not args.no_record:
        _record(rows, args)
    return 0


def _record(rows, args) -> None:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from results_io import append_rows, make_row

    out = []
    for policy, total, cpu, r in rows:
        params = {"num_requests": args.num_requests, "rate": args.rate, "policy": policy, "threads": 1,
                  "workload": "lognormal 512/128, 8x256 shared prefixes, 4 clients", "num_blocks": 4096,
                  "block_size": 16, "steps": r.num_steps}
        for metric, unit, value in (("wall_s", "s", total), ("cpu_s", "s", cpu),
                                    ("requests_per_s", "req/s", args.num_requests / total),
                                    ("us_per_step", "us", total / r.num_steps * 1e6)):
            out.append(make_row("simulator", "servelab", metric, unit, value, params=params))
    path = append_rows(out)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    sys.exit(main())
