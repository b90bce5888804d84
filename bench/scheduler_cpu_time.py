"""Scheduler cost per running request per decode step, in CPU time (for a machine shared with others).

The workload of ``bench/bench_scheduler.py`` (N requests decoding, prefix caching on, a fake model):
``schedule()`` + ``update_from_output()`` timed with ``time.thread_time`` (what this one thread
spent; the wall clock of a shared machine also counts other processes). Reports microseconds per
running request per step: p20/p50/p80 over the steps, and the mean (which includes the steps
where requests cross a block boundary).

The collector: a process that imported torch holds ~200,000 tracked objects, and CPython's
full collection rescans them all every few dozen steps here (~100 ms, against ~1.5 ms for a
step). The serving loops freeze the heap alive at their start for their duration
(``Pipeline.generate``, the simulator: ``servelab._internal.frozen_heap``), so the timed loop
runs as they do, inside ``frozen_heap()``; the mean with the collector scanning everything is
reported beside it (``decode_cpu_us_per_request_mean_live_heap``). Target (issue): <= 1.5 us at
N = 1024.

Usage::

    python bench/scheduler_cpu_time.py [--num-running 1024] [--steps 96] [--threads 1,2] [--no-record]

Threads: the scheduler is single-threaded Python and never calls torch, so
``torch.set_num_threads`` should not change its cost; ``--threads 1,2`` times it
at each count anyway (alternating, so both share the same stretch of a shared
machine's time) and records the count in each row's ``params``, so that every
figure of the thread-scaling work carries its count.
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
    parser.add_argument("--threads", default="1", help="torch thread counts, comma-separated (e.g. 1,2)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    import torch
    from results_io import append_rows, make_row, percentiles

    from servelab._internal.frozen_heap import frozen_heap

    n, rows = args.num_running, []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        with frozen_heap():
            per_request = timed_steps(n, args.steps)
        live = statistics.fmean(timed_steps(n, args.steps))
        q = percentiles(per_request)
        mean = statistics.fmean(per_request)
        print(f"{n} running, {threads} thread(s): us per request per step p20 {q['p20']:.2f} p50 {q['p50']:.2f} "
              f"p80 {q['p80']:.2f} mean {mean:.2f}; mean with the whole heap live to the collector {live:.2f} "
              "(CPU time)")
        params = {"num_running": n, "threads": threads, "clock": "thread_time", "steps": args.steps,
                  "heap": "frozen"}
        rows += [make_row("scheduler", "servelab", "decode_cpu_us_per_request", "us", q["p50"], params=params, **q),
                 make_row("scheduler", "servelab", "decode_cpu_us_per_request_mean", "us", mean, params=params),
                 make_row("scheduler", "servelab", "decode_cpu_us_per_request_mean_live_heap", "us", live,
                          params={**params, "heap": "live"})]
    if not args.no_record:
        print(f"rows appended to {append_rows(rows)}")
    return 0


def timed_steps(n: int, steps: int) -> list[float]:
    """CPU microseconds per running request of each of ``steps`` decode steps (after 5 untimed),
    on a fresh scheduler of ``n`` decoding requests."""
    from bench_scheduler import TOKEN, decoding_scheduler

    from servelab.scheduling import ModelRunnerOutput

    sched = decoding_scheduler(n)
    sampled = [[TOKEN]] * n
    per_request = []
    for step in range(steps + 5):
        t = time.thread_time()
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))
        if step >= 5:
            per_request.append((time.thread_time() - t) * 1e6 / n)
    return per_request


if __name__ == "__main__":
    sys.exit(main())
