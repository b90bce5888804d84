"""Scheduler cost per running request per decode step, in CPU time (for a machine shared with others).

The workload of ``bench/bench_scheduler.py`` (N requests decoding, prefix caching on, a fake model):
``schedule()`` + ``update_from_output()`` timed with ``time.thread_time`` (what this one thread
spent; the wall clock of a shared machine also counts other processes). Reports microseconds per
running request per step: p20/p50/p80 over the steps, and the mean (which includes the block
allocations every 16 steps and the collector's full passes). Target (issue): <= 1.5 us at N = 1024.

Usage::

    python bench/scheduler_cpu_time.py [--num-running 1024] [--steps 96] [--no-record]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-running", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    from bench_scheduler import TOKEN, decoding_scheduler
    from results_io import append_rows, make_row, percentiles

    from servelab.scheduling import ModelRunnerOutput

    n = args.num_running
    sched = decoding_scheduler(n)
    sampled = [[TOKEN]] * n
    per_request = []
    for step in range(args.steps + 5):
        t = time.thread_time()
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))
        if step >= 5:
            per_request.append((time.thread_time() - t) * 1e6 / n)
    q = percentiles(per_request)
    mean = statistics.fmean(per_request)
    print(f"{n} running: us per request per step p20 {q['p20']:.2f} p50 {q['p50']:.2f} p80 {q['p80']:.2f} "
          f"mean {mean:.2f} (CPU time)")
    if not args.no_record:
        params = {"num_running": n, "threads": 1, "clock": "thread_time", "steps": args.steps}
        rows = [make_row("scheduler", "servelab", "decode_cpu_us_per_request", "us", q["p50"], params=params, **q),
                make_row("scheduler", "servelab", "decode_cpu_us_per_request_mean", "us", mean, params=params)]
        print(f"rows appended to {append_rows(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
