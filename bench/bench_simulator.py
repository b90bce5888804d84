"""Simulator speed and memory: a large workload through the real scheduler and KV manager.

Usage::

    taskset -c 0 python bench/bench_simulator.py [--num-requests 100000] [--rate 80] [--policy fcfs]
    taskset -c 0 python bench/bench_simulator.py --num-requests 1000000          # the 1M run (minutes)
    taskset -c 0 python bench/bench_simulator.py --num-requests 2000 --no-record # smoke run

The workload: lognormal prompts around 512 tokens and outputs around 128 (the
CLI's defaults), Poisson arrivals at ``--rate`` (80/s overloads the default
engine: requests queue), 8 shared 256-token system prompts, 4 clients, 3
priorities; 4096 KV blocks of 16 tokens, prefix caching on. The spec goes to
``simulate`` as it is, so requests are generated as they arrive. Per policy it
prints the wall time of the whole ``simulate`` call, the CPU time of the
process, simulated requests per second, microseconds per simulated step and
the process's peak RSS, and appends them to ``bench/results/results.csv``
(component ``simulator``; ``params`` hold the workload, ``threads=1`` and the
1-minute load average at the start and end of the run). Targets: 100k requests
in < 45 s on one idle core, 1M in < 8 min within 4 GB peak RSS.

The machine may be shared: CPU time (``cpu_s``) is what one core spent, the
wall time also counts waiting for the core; the load averages say how shared.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time


def peak_rss_mb() -> float:
    """This process's peak resident set size, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=80.0)
    parser.add_argument("--policy", default="fcfs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true", help="do not append rows to results.csv")
    args = parser.parse_args()

    import torch

    from servelab.scheduling.simulator import WorkloadSpec, format_table, simulate

    torch.set_num_threads(1)
    spec = WorkloadSpec(num_requests=args.num_requests, rate=args.rate, num_prefix_groups=8, prefix_len=256,
                        num_clients=4, num_priorities=3, seed=args.seed)
    results, rows = [], []
    print(f"{'policy':<10}{'simulate s':>12}{'cpu s':>9}{'steps':>9}{'req/s':>9}{'us/step':>9}{'peak MB':>9}"
          f"{'load':>12}")
    for policy in args.policy.split(","):
        load_start = os.getloadavg()[0]
        t, c = time.perf_counter(), time.process_time()
        r = simulate(spec, policy)
        total, cpu = time.perf_counter() - t, time.process_time() - c
        load = (load_start, os.getloadavg()[0])
        results.append(r)
        print(f"{policy:<10}{total:>12.2f}{cpu:>9.2f}{r.num_steps:>9}{args.num_requests / total:>9.0f}"
              f"{total / r.num_steps * 1e6:>9.1f}{peak_rss_mb():>9.0f}{load[0]:>6.1f}{load[1]:>6.1f}")
        rows.append((policy, total, cpu, r, load, peak_rss_mb()))
    print()
    print(format_table(results))
    if not args.no_record:
        _record(rows, args)
    return 0


def _record(rows, args) -> None:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from results_io import append_rows, make_row

    out = []
    for policy, total, cpu, r, load, rss in rows:
        params = {"num_requests": args.num_requests, "rate": args.rate, "policy": policy, "threads": 1,
                  "workload": "lognormal 512/128, 8x256 shared prefixes, 4 clients", "num_blocks": 4096,
                  "block_size": 16, "steps": r.num_steps, "loadavg_1m_start": round(load[0], 2),
                  "loadavg_1m_end": round(load[1], 2), "lazy_workload": True}
        for metric, unit, value in (("wall_s", "s", total), ("cpu_s", "s", cpu),
                                    ("requests_per_s", "req/s", args.num_requests / total),
                                    ("us_per_step", "us", total / r.num_steps * 1e6),
                                    ("peak_rss_mb", "MiB", rss)):
            out.append(make_row("simulator", "servelab", metric, unit, value, params=params))
    path = append_rows(out)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    sys.exit(main())
