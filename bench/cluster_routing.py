"""Cluster benchmarks: routers and P/D on the Mooncake conversation trace, and simulator speed.

Three parts (``--part``), each appending rows to ``bench/results/results.csv``:

- ``routing``: the first ``--num-requests`` requests of the Mooncake
  conversation trace (arrivals at half the trace's rate: ``TIME_SCALE``) on 4 replicas behind each router
  (round robin, least loaded, prefix affinity, consistent hash): prefix hit
  rate, TTFT p50/p90, TPOT p90, imbalance, throughput (component
  ``cluster_routing``), plus prefix affinity / round robin ratios.
- ``pd``: the same trace slice on 4 replicas, colocated (prefix affinity)
  vs every p:d split (1:3, 2:2, 3:1), KV bandwidth 1..400 Gb/s: TTFT and TPOT
  p50/p90, e2e p90, throughput, failed, and the decode side's counters
  (transfers, those a decode scheduler passed over, the mean hand-off to
  transfer start, transferred / cached / recomputed tokens;
  decode replicas load the KV through their scheduler's connector path)
  (component ``cluster_pd``) and a figure ``bench/results/cluster_pd.png``.
- ``speed``: wall time of ``simulate_cluster`` for 100,000 generated requests
  on 8 replicas (component ``cluster_sim``), one process.

Replica model (every part): the default step-cost model (a 7B fp16 model on
one A100-class GPU), 131,072 tokens of KV per replica (2,048 blocks of 64
tokens: block size 64 divides Mooncake's 512-token hash blocks, so hits are
exact), chunked prefill of 8,192 tokens per step, 128 sequences, prompts
clipped at 32,768 tokens. KV bytes per token for P/D: 512 KiB (32 layers x
32 KV heads x 128 x fp16).

Usage::

    python bench/cluster_routing.py --part routing --num-requests 2000 --jobs 2
    python bench/cluster_routing.py --part routing --num-requests 2000 --num-blocks 32768  # 16x cache
    python bench/cluster_routing.py --part pd --num-requests 600 --jobs 2
    python bench/cluster_routing.py --part pd --num-requests 600 --bandwidths 100     # one bandwidth, no figure
    python bench/cluster_routing.py --part speed
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import append_rows, make_row  # noqa: E402

from servelab.cluster import simulate_cluster  # noqa: E402
from servelab.cluster.sweep import run_sweep  # noqa: E402
from servelab.scheduling.config import SchedulerConfig  # noqa: E402
from servelab.scheduling.simulator import LengthDist, WorkloadSpec  # noqa: E402

ROUTERS = ("round_robin", "least_loaded", "prefix_affinity", "consistent_hash")
REPLICA = {"block_size": 64, "num_blocks": 2048, "max_num_batched_tokens": 8192, "max_num_seqs": 128,
           "max_model_len": 32768}
BANDWIDTHS = (1, 3, 10, 25, 50, 100, 200, 400)
SPLITS = ((1, 3), (2, 2), (3, 1))
FIGURE = Path(__file__).resolve().parent / "results" / "cluster_pd.png"


TIME_SCALE = 2.0
"""Arrivals at half the trace's rate: at its own rate the first 2,000 requests (3.1 req/s of ~12k-token
prompts, 343-token outputs) need ~2.5 of these replicas for prefill alone and 4 replicas overload (TTFT of minutes)."""


def trace_point(num_requests: int, **extra) -> dict:
    return {"trace": "mooncake_conversation", "max_requests": num_requests, "time_scale": TIME_SCALE, **REPLICA,
            **extra}


def routing(num_requests: int, jobs: int, num_blocks: int) -> list[dict]:
    points = [trace_point(num_requests, replicas=4, router=r, num_blocks=num_blocks) for r in ROUTERS]
    results = run_sweep(points, jobs=jobs)
    rows = []
    params = {"trace": "mooncake_conversation", "num_requests": num_requests, "replicas": 4, **REPLICA,
              "num_blocks": num_blocks, "time_scale": TIME_SCALE}
    for res in results:
        print(f"{res['router']:>16}: hit {res['prefix_hit_rate']:.3f}  TTFT p50 {res['ttft_p50']:.2f}s "
              f"p90 {res['ttft_p90']:.2f}s  TPOT p90 {res['tpot_p90'] * 1e3:.1f}ms  imbalance "
              f"{res['imbalance']:.2f}  throughput {res['throughput_tok_s']:.0f} tok/s  wall {res['wall_s']:.0f}s")
        for metric, unit in (("prefix_hit_rate", "fraction"), ("ttft_p50", "s"), ("ttft_p90", "s"),
                             ("tpot_p90", "s"), ("imbalance", "max/mean"), ("throughput_tok_s", "tok/s"),
                             ("goodput_req_s", "req/s")):
            rows.append(make_row("cluster_routing", res["router"], metric, unit, res[metric], params=params))
    by = {r["router"]: r for r in results}
    pa, rr = by["prefix_affinity"], by["round_robin"]
    ratios = {"hit_rate_ratio": pa["prefix_hit_rate"] / max(rr["prefix_hit_rate"], 1e-12),
              "ttft_p90_ratio": pa["ttft_p90"] / rr["ttft_p90"],
              "throughput_ratio": pa["throughput_tok_s"] / rr["throughput_tok_s"]}
    for metric, value in ratios.items():
        rows.append(make_row("cluster_routing", "prefix_affinity_vs_round_robin", metric, "x", value,
                             params=params))
    print("prefix affinity / round robin:", {k: round(v, 3) for k, v in ratios.items()})
    return rows


def pd(num_requests: int, jobs: int, bandwidths: tuple[float, ...] = BANDWIDTHS) -> list[dict]:
    points = [trace_point(num_requests, replicas=4, router="prefix_affinity")]
    points += [trace_point(num_requests, router="prefix_affinity", prefill_replicas=p, decode_replicas=d,
                           kv_bandwidth_gbps=float(bw), kv_latency_s=1e-3)
               for p, d in SPLITS for bw in bandwidths]
    results = run_sweep(points, jobs=jobs)
    params = {"trace": "mooncake_conversation", "num_requests": num_requests, "replicas": 4, **REPLICA,
              "time_scale": TIME_SCALE}
    rows = []
    for res in results:
        split = f"{res['pd_prefill']}:{res['pd_decode']}" if "pd_prefill" in res else "colocated"
        p = {**params, "split": split, "kv_bandwidth_gbps": res.get("pd_bandwidth_gbps"),
             "loadavg_1m": round(os.getloadavg()[0], 2)}
        print(f"{split:>9} bw={res.get('pd_bandwidth_gbps', '-')!s:>5}: failed {res['failed']}  TTFT p90 "
              f"{res['ttft_p90']:.2f}s TPOT p90 {res['tpot_p90'] * 1e3:.1f}ms  kv waits {res.get('pd_kv_waits', 0)}  "
              f"decode recomputed {res.get('pd_decode_recomputed_tokens', 0)} tokens in "
              f"{res.get('pd_decode_recomputed_requests', 0)} requests")
        for metric in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "e2e_p90"):
            rows.append(make_row("cluster_pd", split, metric, "s", res[metric], params=p))
        rows.append(make_row("cluster_pd", split, "failed", "count", res["failed"], params=p))
        rows.append(make_row("cluster_pd", split, "throughput_tok_s", "tok/s", res["throughput_tok_s"], params=p))
        for key in ("transfers", "kv_waits", "transferred_tokens", "decode_cached_tokens",
                    "decode_recomputed_tokens", "decode_recomputed_requests", "kv_wait_s_mean"):
            if f"pd_{key}" in res:
                rows.append(make_row("cluster_pd", split, key, "s" if key.endswith("_s_mean") else "count",
                                     res[f"pd_{key}"], params=p))
    if len(bandwidths) > 1:  # the figure needs the bandwidth axis
        plot_pd(results, FIGURE)
        print(f"figure: {FIGURE}")
    return rows


def plot_pd(results: list[dict], path: Path) -> None:
    """TTFT and TPOT p90 vs KV bandwidth: each p:d split, the best split, colocated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colocated = next(r for r in results if "pd_prefill" not in r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in ((axes[0], "ttft_p90", "TTFT p90 (s)"), (axes[1], "tpot_p90", "TPOT p90 (s)")):
        for p, d in SPLITS:
            rs = sorted((r for r in results if r.get("pd_prefill") == p and r.get("pd_decode") == d),
                        key=lambda r: r["pd_bandwidth_gbps"])
            ax.plot([r["pd_bandwidth_gbps"] for r in rs], [r[metric] for r in rs], marker="o", label=f"P/D {p}:{d}")
        ax.axhline(colocated[metric], color="k", linestyle="--", label="colocated x4")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("KV link bandwidth per prefill replica (Gb/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Mooncake conversation trace, 4 replicas: disaggregated vs colocated")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speed(num_requests: int, replicas: int) -> list[dict]:
    workload = WorkloadSpec(num_requests=num_requests, rate=12.0 * replicas,
                            prompt_len=LengthDist("lognormal", 256, 0.6), output_len=LengthDist("lognormal", 48, 0.6),
                            num_prefix_groups=64, prefix_len=256, seed=0)
    start = time.perf_counter()
    res = simulate_cluster(workload, replicas=replicas, router="prefix_affinity",
                           scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256,
                                                            max_model_len=8192))
    wall = time.perf_counter() - start
    s = res.summary()
    print(f"{num_requests} requests, {replicas} replicas: {wall:.1f}s wall ({s['steps']} steps, "
          f"hit {s['prefix_hit_rate']:.3f}, TTFT p90 {s['ttft_p90']:.2f}s, imbalance {res.imbalance:.2f})")
    params = {"num_requests": num_requests, "replicas": replicas, "router": "prefix_affinity", "rate": workload.rate,
              "prompt_len": "lognormal:256:0.6", "output_len": "lognormal:48:0.6", "prefix_groups": 64,
              "prefix_len": 256, "steps": s["steps"], "threads": 1, "load_avg_1m": round(os.getloadavg()[0], 2)}
    return [make_row("cluster_sim", "servelab", "wall_s", "s", wall, params=params)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["routing", "pd", "speed"], required=True)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--replicas", type=int, default=8, help="speed part only")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="routing part: KV blocks (of 64 tokens) per replica (default 2048: 131k tokens)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--bandwidths", default=",".join(map(str, BANDWIDTHS)),
                        help="pd part: KV link bandwidths in Gb/s, comma-separated (the figure needs two or more)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    if args.part == "routing":
        rows = routing(args.num_requests or 2000, args.jobs, args.num_blocks or REPLICA["num_blocks"])
    elif args.part == "pd":
        try:
            bandwidths = tuple(float(b) for b in args.bandwidths.split(","))
        except ValueError:
            parser.error(f"--bandwidths {args.bandwidths!r}: valid: numbers in Gb/s, comma-separated")
        rows = pd(args.num_requests or 600, args.jobs, bandwidths)
    else:
        rows = speed(args.num_requests or 100_000, args.replicas)
    if not args.no_record:
        print(f"results: {append_rows(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
