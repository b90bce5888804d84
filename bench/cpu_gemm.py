"""The few-row C GEMM (``servelab.models.cpu_gemm``) against ``F.linear`` and oneDNN's packed GEMM.

One "forward" is every weight matrix of a model's decoder (fused QKV, O,
fused gate-up, down per layer; no LM head), each multiplied by a
``[rows, in]`` activation, in layer order, as a decode step runs them. Before
each timed forward a 4 MiB buffer is written, so the weights come from
memory or a shared L3 as they do in a step (a step's other work evicts
them), not from the core's own caches. Three kernels on the same weights,
interleaved within each round:

- ``f_linear``: ``F.linear`` on the dense weights (the reference);
- ``onednn_packed``: ``torch.ops.mkldnn._linear_pointwise`` on weights packed
  once (what :mod:`servelab.models.linear` runs from ``MAX_ROWS + 1`` rows on);
- ``panels``: the C kernel on :func:`servelab.models.cpu_gemm.pack`'s panels
  (what it runs up to ``cpu_gemm.MAX_ROWS`` rows).

The machine's own yardstick is in the same rows: ``read_floor`` is the
weights' bytes over the rate ``torch.sum`` reads them at in the same state
(cold, same buffer write before), the least time any GEMM needs to stream them.

    python bench/cpu_gemm.py                        # tiny + SmolLM2 shapes, rows 1..64, 1 thread
    python bench/cpu_gemm.py --threads 1,2 --rows 1,16

Rows: component ``cpu_gemm``, implementation = the kernel, metric
``forward_ms`` (p20/p50/p80 over rounds), params: model shapes, rows, threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from servelab.models import cpu_gemm

#: (hidden, intermediate, q heads * head dim, kv heads * head dim, layers) per model.
SHAPES = {"tiny": (256, 768, 64, 32, 4), "smollm2": (576, 1536, 576, 192, 30)}
_EVICT = torch.empty(1 << 20)  # 4 MiB


def weights(model: str) -> list[torch.Tensor]:
    """The decoder's weight matrices ``[out, in]`` in the order a forward runs them."""
    hidden, inter, q, kv, layers = SHAPES[model]
    gen = torch.Generator().manual_seed(0)
    per_layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    return [torch.randn(shape, generator=gen) / shape[1] ** 0.5 for _ in range(layers) for shape in per_layer]


def forwards(ws: list[torch.Tensor], rows: int) -> dict:
    """kernel name -> a callable running one forward's GEMMs at ``rows`` rows."""
    gen = torch.Generator().manual_seed(rows)
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen) for w in ws}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
    panels = [cpu_gemm.pack(w) for w in ws]
    return {
        "f_linear": lambda: [F.linear(xs[w.shape[1]], w) for w in ws],
        "onednn_packed": lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                  for w, p in zip(ws, packed)],
        "panels": lambda: [cpu_gemm.gemm(xs[w.shape[1]], p, None, w.shape[0]) for w, p in zip(ws, panels)],
        "read_floor": lambda: [w.sum() for w in ws],
    }


def time_cold(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls, the evicting write before each."""
    times = []
    for _ in range(repeats):
        _EVICT.fill_(1.0)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(model: str, rows_list: list[int], threads_list: list[int], rounds: int, repeats: int) -> list[dict]:
    ws = weights(model)
    results = []
    for rows in rows_list:
        kernels = forwards(ws, rows)
        for threads in threads_list:
            torch.set_num_threads(threads)
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for r in range(rounds):
                names = list(kernels) if r % 2 == 0 else list(kernels)[::-1]
                for name in names:
                    kernels[name]()  # panels / packing made, caches in their steady state
                    times[name].append(time_cold(kernels[name], repeats))
            for name, values in times.items():
                results.append(dict(model=model, rows=rows, threads=threads, kernel=name, times=values))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--rows", default="1,4,8,16,32,64")
    parser.add_argument("--threads", default="1", help="torch thread counts, comma-separated (e.g. 1,2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=11, help="timed forwards per kernel and round")
    parser.add_argument("--no-record", action="store_true", help="print only; no rows in results.csv")
    args = parser.parse_args()
    if cpu_gemm._library() is None:
        print("the C kernel library is unavailable (no compiler, or SERVELAB_CPU_KERNELS=0): nothing to time")
        return 1
    results = [res for model in args.models.split(",")
               for res in run(model, [int(r) for r in args.rows.split(",")],
                              [int(t) for t in args.threads.split(",")], args.rounds, args.repeats)]
    print("| model | rows | threads | f_linear ms | onednn_packed ms | panels ms | read floor ms |")
    print("|---|---|---|---|---|---|---|")
    by_key: dict[tuple, dict] = {}
    for res in results:
        by_key.setdefault((res["model"], res["rows"], res["threads"]), {})[res["kernel"]] = res["times"]
    for (model, rows, threads), kernels in by_key.items():
        cells = " | ".join(f"{1e3 * statistics.median(kernels[k]):.3f}"
                           for k in ("f_linear", "onednn_packed", "panels", "read_floor"))
        print(f"| {model} | {rows} | {threads} | {cells} |")
    if not args.no_record:
        from results_io import append_rows, make_row, percentiles

        rows_out = []
        for res in results:
            spread = percentiles([1e3 * t for t in res["times"]])
            params = dict(model=res["model"], rows=res["rows"], threads=res["threads"], rounds=args.rounds,
                          repeats=args.repeats, evict_bytes=_EVICT.numel() * 4)
            rows_out.append(make_row("cpu_gemm", res["kernel"], "forward_ms", "ms", spread["p50"], params=params,
                                     **spread))
        append_rows(rows_out)
        print(f"{len(rows_out)} rows appended to results.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
