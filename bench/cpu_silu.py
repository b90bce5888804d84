"""The C SiLU (``servelab.models.cpu_silu``) against torch's in-place SiLU, its reference and peer.

On the decode glue's own operand: the gate ``[rows, I]``, a view of gate_up ``[rows, 2I]`` (the row
stride 2I), in place, warm (the glue runs it right after the gate-up GEMM wrote it). Two kernels on
the same values, interleaved within each round:

- ``torch``: ``torch._C._nn.silu_``, what ``F.silu(..., inplace=True)`` calls (single-threaded below
  torch's grain of 32,768 elements, whatever the thread count);
- ``c``: ``cpu_silu.silu_`` (its argument checks, then ``servelab_silu_rows``, rows split over the
  thread count; bit-identical: the module's probe);
- ``c_call``: the C call alone, as the glue makes it inside its down call (no Python of its own).

Only shapes the C SiLU takes (``rows * I < 32,768``) are timed.

    python bench/cpu_silu.py                          # SmolLM2's and the tiny model's gates, 1 and 2 threads
    python bench/cpu_silu.py --rows 1,16 --threads 2 --no-record

Rows: component ``cpu_silu``, implementation = the kernel, metric ``silu_us`` (p20/p50/p80 over
rounds), params: intermediate size, rows, threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from servelab.attention import cpu_decode
from servelab.models import cpu_silu

#: the glue's intermediate size per model
INTERMEDIATE = {"tiny": 768, "smollm2": 1536}


def time_calls(fn, gate_up: torch.Tensor, repeats: int) -> float:
    """Median microseconds of ``fn`` over ``repeats`` calls, the values refreshed (not timed) before each:
    SiLU in place would otherwise converge to its fixed point."""
    source, times = gate_up.clone(), []
    for _ in range(repeats):
        gate_up.copy_(source)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def run(model: str, rows_list: list[int], threads_list: list[int], rounds: int, repeats: int) -> list[dict]:
    inter, results = INTERMEDIATE[model], []
    for rows in rows_list:
        if not cpu_silu.usable(rows, inter):
            print(f"skipped: {rows} x {inter} (the C SiLU does not take it: {cpu_silu.unavailable_reason()} "
                  f"or >= {cpu_silu.TORCH_GRAIN} elements)")
            continue
        gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 4
        gate = gate_up[:, :inter]
        for threads in threads_list:
            torch.set_num_threads(threads)
            call, at = cpu_decode.library().servelab_silu_rows, gate.data_ptr()
            kernels = {"torch": lambda: torch._C._nn.silu_(gate), "c": lambda: cpu_silu.silu_(gate),
                       "c_call": lambda: call(at, rows, inter, 2 * inter, threads)}
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for r in range(rounds):
                for name in (list(kernels) if r % 2 == 0 else list(kernels)[::-1]):
                    times[name].append(time_calls(kernels[name], gate_up, repeats))
            results += [dict(model=model, intermediate=inter, rows=rows, threads=threads, kernel=name, times=v)
                        for name, v in times.items()]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=201, help="timed calls per kernel and round")
    parser.add_argument("--no-record", action="store_true", help="print only; no rows in results.csv")
    args = parser.parse_args()
    if not cpu_silu.available():
        print(f"the C SiLU is unavailable: {cpu_silu.unavailable_reason()}: nothing to time")
        return 1
    results = [res for model in args.models.split(",")
               for res in run(model, [int(r) for r in args.rows.split(",")],
                              [int(t) for t in args.threads.split(",")], args.rounds, args.repeats)]
    print("| model | rows | threads | torch us | c us | c_call us | torch / c_call |")
    print("|---|---|---|---|---|---|---|")
    by_key: dict[tuple, dict] = {}
    for res in results:
        by_key.setdefault((res["model"], res["rows"], res["threads"]), {})[res["kernel"]] = res["times"]
    for (model, rows, threads), kernels in by_key.items():
        torch_us, c_us, call_us = (statistics.median(kernels[k]) for k in ("torch", "c", "c_call"))
        print(f"| {model} | {rows} | {threads} | {torch_us:.2f} | {c_us:.2f} | {call_us:.2f} | "
              f"{torch_us / call_us:.2f} |")
    if not args.no_record:
        from results_io import append_rows, make_row, percentiles

        rows_out = []
        for res in results:
            spread = percentiles(res["times"])
            params = dict(model=res["model"], intermediate=res["intermediate"], rows=res["rows"],
                          threads=res["threads"], rounds=args.rounds, repeats=args.repeats)
            rows_out.append(make_row("cpu_silu", res["kernel"], "silu_us", "us", spread["p50"], params=params,
                                     **spread))
        append_rows(rows_out)
        print(f"{len(rows_out)} rows appended to results.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
