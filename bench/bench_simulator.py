"""Simulator speed: a 10,000-request trace through each policy, timed.

Usage::

    taskset -c 0 python bench/bench_simulator.py [--num-requests 10000] [--rate 8]

The workload is the CLI's default (lognormal prompts around 512 tokens and
outputs around 128, Poisson arrivals) with 8 shared 256-token system prompts
and 4 clients; 4096 KV blocks of 16 tokens. Prints, per policy, the wall time
of the whole ``simulate`` call (scheduler, KV manager, metrics) and of its
loop, and the simulated steps per second; the aim is under a minute per run on
one CPU core.
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--policy", default="fcfs,priority,sjf,vtc")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from servelab.scheduling.simulator import WorkloadSpec, format_table, generate_workload, simulate

    t0 = time.perf_counter()
    spec = WorkloadSpec(num_requests=args.num_requests, rate=args.rate, num_prefix_groups=8, prefix_len=256,
                        num_clients=4, num_priorities=3, seed=args.seed)
    requests = generate_workload(spec)
    print(f"workload: {args.num_requests} requests at {args.rate}/s generated in {time.perf_counter() - t0:.2f} s")
    results = []
    print(f"{'policy':<10}{'simulate s':>12}{'loop s':>9}{'steps':>9}{'steps/s':>10}{'sim time s':>12}")
    for policy in args.policy.split(","):
        t = time.perf_counter()
        r = simulate(requests, policy)
        total = time.perf_counter() - t
        results.append(r)
        print(f"{policy:<10}{total:>12.2f}{r.wall_s:>9.2f}{r.num_steps:>9}{r.num_steps / r.wall_s:>10.0f}"
              f"{r.duration_s:>12.0f}")
    print()
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
