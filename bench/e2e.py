"""End-to-end on CPU: servelab's Pipeline vs transformers (batched ``generate`` and continuous
batching, ``generate_batch``), same process, interleaved.

Workloads (``--workloads``, comma-separated):

- ``tiny``: a random tiny Llama (hidden 256, 4 layers), 16 prompts of 8-64
  tokens x 32 new tokens, greedy, float32;
- ``smollm2``: SmolLM2-135M-Instruct when its converted folder exists
  (:func:`servelab.models.hub.fetch_smollm2`), else a random checkpoint with
  its shapes (hidden 576, 30 layers, GQA 9/3, vocabulary 49,152); 16 prompts
  of 36-264 tokens x 64 new tokens, greedy, float32;
- ``online``: a heterogeneous online workload on the tiny model: 128 requests,
  Poisson arrivals, prompt and output lengths lognormal. servelab serves them
  as they arrive (continuous batching) and reports TTFT / TPOT. The peer is
  transformers' own continuous batching (``init_continuous_batching``, the
  manager behind ``generate_batch``: requests added as they arrive, per-token
  timestamps), implementation ``transformers-cb``; transformers' fixed-batch
  ``generate`` (batches of ``--hf-batch`` in arrival order, each started once
  its last request has arrived and the previous batch is done; a streamer
  gives its TTFT / TPOT) stays as a second row, ``transformers-fixed-batch``.
  Two arrival rates by default (``--online-rate 64,512``): at 64/s servelab
  keeps up with the arrivals (TTFT p50 a few ms), so its throughput is the
  arrival process's, about the offered load, and its ratio to a saturated peer
  is a lower bound; at 512/s every engine is saturated, so throughput is each
  engine's capacity. Each row says which: ``throughput_over_offered``, the
  engine's throughput over the offered load (output tokens over the arrival
  span); near 1 means it kept up.

Peers on the batch workloads: ``transformers`` (left-padded batched
``generate``, ``attn_implementation="sdpa"``) and ``transformers-cb``
(``generate_batch``, continuous batching with ``paged|sdpa`` attention; its
KV cache sized to the workload, as servelab's, since the default sizes it
from free accelerator memory).

OpenMP: on a machine with more runnable threads than cores, run with
``OMP_WAIT_POLICY=PASSIVE`` in the environment (it applies to both engines,
which share the process): with the default policy an idle OpenMP worker
spins and takes a core from the thread doing the serial work, which made
2-thread runs 10-15x slower than 1-thread runs for every engine on a 2-core
machine shared with other jobs. On an otherwise idle machine leave the default:
PASSIVE puts idle workers to sleep, and waking one costs ~50 us per parallel
region (one few-row GEMM: 57 us on 2 threads against 11 us with the default
policy), which servelab's many small regions per step pay more often than
transformers does. The policy is in each row's ``params``.

Threads: ``--threads 1,2`` runs every engine at each count
(``torch.set_num_threads``, which the C decode kernel follows too) inside each
repeat, so all counts and engines share the same stretch of a shared
machine's time; the engines' order rotates from repeat to repeat. Each row's
``params`` holds its thread count.

For the two batch workloads every repeat runs every engine back to back
(medians over ``--repeats``, with p20/p80; the machine may be shared, so only
ratios within one run are meaningful), greedy with EOS ignored, prefix
caching off (repeats reuse the prompts), and counts the requests whose
tokens equal transformers' (its batch is left-padded, so a few may differ in
the last float bits and then diverge). servelab runs with ``detokenize=False``
(text decoded once at the end, as a transformers user calls ``batch_decode``;
incremental detokenization is for streaming and stop strings). Throughput is
wall-clock; the CPU-time ratio (``time.process_time``, one thread) is
reported beside it because it is far less sensitive to other processes on a
shared machine. Peak RSS of each engine is measured in
a fresh child process running the workload once (``--no-rss`` skips it).

    python bench/e2e.py                             # all workloads; rows into bench/results/results.csv
    python bench/e2e.py --workloads smollm2,online --threads 1,2 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from e2e_peers import (  # noqa: E402 (bench/ is sys.path[0] when run as a script)
    hf_generate, hf_generate_batch, load_hf, load_hf_cb, make_pipeline, online_requests, serve_online_hf,
    serve_online_hf_cb, serve_online_servelab,
)
from options import comma_separated  # noqa: E402
from profile_step import build, workload  # noqa: E402

BATCH = {"tiny": dict(num_prompts=16, prompt=(8, 64), max_tokens=32),
         "smollm2": dict(num_prompts=16, prompt=(36, 264), max_tokens=64)}


def checkpoint(name: str, root: Path) -> tuple[Path, str]:
    """(folder, description) for ``tiny`` or ``smollm2`` (real when fetched, else its shapes)."""
    if name == "smollm2":
        try:
            from servelab.models.hub import is_fetched, smollm2_path

            if is_fetched():
                return smollm2_path(), "SmolLM2-135M-Instruct (real weights)"
        except ImportError:
            pass
        return build("smollm2-shape", root), "random weights with SmolLM2-135M's shapes"
    return build("tiny", root), "random tiny Llama (hidden 256, 4 layers)"


def batch_prompts(name: str, vocab: int) -> tuple[list[list[int]], int]:
    spec = BATCH[name]
    return workload(spec["num_prompts"], *spec["prompt"], min(vocab, 500), seed=0), spec["max_tokens"]


ENGINES = ("servelab", "transformers", "transformers-cb")


def run_batch(name: str, repeats: int, threads: list[int], record: list) -> list[dict]:
    """Every engine at every thread count once per repeat (order rotating); one result per thread count."""
    from servelab.samplers import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path, what = checkpoint(name, Path(tmp))
        hf, hf_cb = load_hf(path), load_hf_cb(path)
        prompts, max_tokens = batch_prompts(name, hf.config.vocab_size)
        pipe = make_pipeline(path, len(prompts), max(map(len, prompts)) + max_tokens + 16)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runners = {
        "servelab": lambda: [o.token_ids for o in pipe.generate(prompts, params, detokenize=False)],
        "transformers": lambda: hf_generate(hf, prompts, max_tokens),
        "transformers-cb": lambda: hf_generate_batch(hf_cb, prompts, max_tokens),
    }
    pipe.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    hf_generate(hf, prompts[:2], 2)
    hf_generate_batch(hf_cb, prompts[:2], 2)
    n_out = len(prompts) * max_tokens
    tps = {(e, t): [] for e in ENGINES for t in threads}
    cpu = {(e, t): [] for e in ENGINES for t in threads}
    outputs: dict = {}
    for rep in range(repeats):
        for t in threads:
            torch.set_num_threads(t)
            for k in range(len(ENGINES)):
                engine = ENGINES[(k + rep) % len(ENGINES)]
                start, cpu_start = time.perf_counter(), time.process_time()
                outputs[engine] = runners[engine]()
                tps[engine, t].append(n_out / (time.perf_counter() - start))
                cpu[engine, t].append(time.process_time() - cpu_start)
                print(f"  repeat {rep} threads {t} {engine}: {tps[engine, t][-1]:.1f} tok/s", flush=True)
    results = []
    for t in threads:
        med = {e: statistics.median(tps[e, t]) for e in ENGINES}
        same = {e: sum(a == b for a, b in zip(outputs[e], outputs["transformers"])) for e in ENGINES}
        result = dict(workload=name, model=what, prompts=len(prompts), max_tokens=max_tokens, threads=t,
                      servelab_tps=med["servelab"], hf_tps=med["transformers"], cb_tps=med["transformers-cb"],
                      same=same["servelab"], cb_same=same["transformers-cb"],
                      servelab_all=tps["servelab", t], hf_all=tps["transformers", t], cb_all=tps["transformers-cb", t])
        result["ratio"] = med["servelab"] / med["transformers"]
        result["cb_ratio"] = med["servelab"] / med["transformers-cb"]
        result["cpu_ratio"] = statistics.median(cpu["transformers", t]) / statistics.median(cpu["servelab", t])
        params_row = dict(workload=name, model=what, prompts=len(prompts), max_tokens=max_tokens, threads=t,
                          repeats=repeats)
        for engine in ENGINES:
            record.append(("e2e", engine, "output_throughput", "tok/s", med[engine], params_row, tps[engine, t]))
        for peer, key in (("transformers", "ratio"), ("transformers-cb", "cb_ratio")):
            per_repeat = [a / b for a, b in zip(tps["servelab", t], tps[peer, t])]
            record.append(("e2e", "servelab", f"throughput_ratio_vs_{peer}", "ratio", result[key], params_row,
                           per_repeat))
        record.append(("e2e", "servelab", "cpu_time_ratio_vs_transformers", "ratio", result["cpu_ratio"],
                       params_row, None))
        results.append(result)
    if len(threads) > 1:
        low, high = min(threads), max(threads)
        for engine in ENGINES:
            scaling = [b / a for a, b in zip(tps[engine, low], tps[engine, high])]
            record.append(("e2e", engine, f"scaling_{high}_over_{low}_threads", "ratio", statistics.median(scaling),
                           dict(workload=name, model=what, threads=f"{low},{high}", repeats=repeats), scaling))
            results[-1][f"{engine}_scaling"] = statistics.median(scaling)
    return results


ONLINE_ENGINES = ("servelab", "transformers-cb", "transformers-fixed-batch")


def offered_token_rate(requests) -> float:
    """Output tokens per second the workload asks for: its output tokens over its arrival span. An
    engine whose throughput is near it keeps up with the arrivals (its throughput is then the
    arrival process's, not its own capacity); one well below it is saturated."""
    span = requests[-1][0] - requests[0][0]
    return sum(olen for _, _, olen in requests) / span if span > 0 else float("inf")


def run_online(args, threads: list[int], record: list) -> list[dict]:
    """Every online engine at every thread count and arrival rate (``--online-rate``, comma-separated)."""
    with tempfile.TemporaryDirectory() as tmp:
        path, what = checkpoint("tiny", Path(tmp))
        hf, hf_cb = load_hf(path), load_hf_cb(path)
        pipe = make_pipeline(path, 64, 512 + 256 + 16)
    results = []
    for rate in args.online_rate:
        requests = online_requests(args.online_requests, rate, 0, hf.config.vocab_size)
        serve = {"servelab": lambda: serve_online_servelab(pipe, requests),
                 "transformers-cb": lambda: serve_online_hf_cb(hf_cb, requests),
                 "transformers-fixed-batch": lambda: serve_online_hf(hf, requests, args.hf_batch)}
        runs = {(e, t): [] for e in ONLINE_ENGINES for t in threads}
        for rep in range(args.repeats):
            for t in threads:
                torch.set_num_threads(t)
                for k in range(len(ONLINE_ENGINES)):
                    engine = ONLINE_ENGINES[(k + rep) % len(ONLINE_ENGINES)]
                    runs[engine, t].append(serve[engine]())
                    print(f"  online {rate:g}/s repeat {rep} threads {t} {engine}: "
                          f"{runs[engine, t][-1]['throughput']:.1f} tok/s", flush=True)
        offered = offered_token_rate(requests)
        results += [online_result(args, what, len(requests), rate, offered, t, runs, record) for t in threads]
    return results


def online_result(args, what: str, num_requests: int, rate: float, offered: float, t: int, runs: dict,
                  record: list) -> dict:
    """One (rate, thread count)'s medians and ratios (``offered``: :func:`offered_token_rate` of the
    workload), its rows appended to ``record``."""
    params_row = dict(workload="online", model=what, requests=num_requests, rate=rate, hf_batch=args.hf_batch,
                      threads=t, repeats=args.repeats)
    result = dict(params_row, offered=offered)
    record.append(("e2e", "workload", "offered_token_rate", "tok/s", offered, params_row, None))
    for engine in ONLINE_ENGINES:
        for key, unit in (("throughput", "tok/s"), ("ttft_p50", "s"), ("ttft_p90", "s"), ("tpot_p50", "s")):
            values = [s[key] for s in runs[engine, t]]
            result[f"{engine}_{key}"] = statistics.median(values)
            record.append(("e2e", engine, key, unit, result[f"{engine}_{key}"], params_row, values))
        result[f"{engine}_load"] = result[f"{engine}_throughput"] / offered
        record.append(("e2e", engine, "throughput_over_offered", "ratio", result[f"{engine}_load"], params_row, None))
    for peer in ONLINE_ENGINES[1:]:
        per_repeat = [a["throughput"] / b["throughput"] for a, b in zip(runs["servelab", t], runs[peer, t])]
        result[f"ratio_{peer}"] = result["servelab_throughput"] / result[f"{peer}_throughput"]
        record.append(("e2e", "servelab", f"throughput_ratio_vs_{peer}", "ratio", result[f"ratio_{peer}"],
                       params_row, per_repeat))
    return result


# ---- peak memory in a child process ---------------------------------------------------------

def child(engine: str, name: str) -> None:
    """Run one batch workload once with one engine; print peak RSS (MiB) as JSON."""
    from servelab.samplers import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path, _ = checkpoint(name, Path(tmp))
        if engine == "transformers":
            model = load_hf(path)
            prompts, max_tokens = batch_prompts(name, model.config.vocab_size)
            hf_generate(model, prompts, max_tokens)
        else:
            from servelab import Pipeline

            pipe = Pipeline.from_pretrained(path, attention_backend="sdpa")  # default sizing: what a user gets
            prompts, max_tokens = batch_prompts(name, pipe.model_config.vocab_size)
            pipe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                          detokenize=False)
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child
    # started from a big parent would report the parent's peak.
    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
    hwm = [line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")]
    peak = int(hwm[0]) / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_rss_mib": peak}))


def peak_rss(engine: str, name: str, threads: int) -> float:
    proc = subprocess.run([sys.executable, __file__, "--child", engine, "--workloads", name, "--threads",
                           str(threads)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"peak-RSS child ({engine}, {name}) failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_mib"]


def _range(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}"


def report(results: list[dict], rss: dict, threads: list[int]) -> str:
    import datetime
    import platform

    lines = [f"# End-to-end on CPU ({datetime.date.today()}, {platform.machine()}, torch thread counts "
             f"{threads}, torch {torch.__version__})", "",
             "| workload | model | threads | servelab tok/s (range) | transformers generate tok/s | "
             "transformers generate_batch tok/s | vs generate | vs generate_batch | CPU-time ratio | identical "
             "outputs | peak RSS servelab / transformers (MiB) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["workload"] == "online":
            continue
        mem = rss.get(r["workload"])
        mem_text = f"{mem[0]:.0f} / {mem[1]:.0f}" if mem else "-"
        lines.append(f"| {r['prompts']} prompts x {r['max_tokens']} tokens ({r['workload']}) | {r['model']} | "
                     f"{r['threads']} | {r['servelab_tps']:.1f} ({_range(r['servelab_all'])}) | {r['hf_tps']:.1f} "
                     f"({_range(r['hf_all'])}) | {r['cb_tps']:.1f} ({_range(r['cb_all'])}) | **{r['ratio']:.2f}x** | "
                     f"**{r['cb_ratio']:.2f}x** | {r['cpu_ratio']:.2f}x | {r['same']}/{r['prompts']} "
                     f"(generate_batch {r['cb_same']}/{r['prompts']}) | {mem_text} |")
        for engine in ENGINES:
            if f"{engine}_scaling" in r:
                lines.append(f"\n{engine}: {max(threads)}-thread / {min(threads)}-thread throughput "
                             f"{r[f'{engine}_scaling']:.2f}x ({r['workload']}).")
    for r in results:
        if r["workload"] != "online":
            continue
        lines += ["", f"Online, {r['threads']} thread(s): {r['requests']} requests, Poisson {r['rate']}/s, lognormal "
                  f"lengths, {r['model']}.", "",
                  "| engine | throughput tok/s | throughput / offered | TTFT p50 s | TTFT p90 s | TPOT p50 ms |",
                  "|---|---|---|---|---|---|"]
        for engine in ONLINE_ENGINES:
            lines.append(f"| {engine} | {r[f'{engine}_throughput']:.1f} | {r[f'{engine}_load']:.2f} | "
                         f"{r[f'{engine}_ttft_p50']:.3f} | {r[f'{engine}_ttft_p90']:.3f} | "
                         f"{1e3 * r[f'{engine}_tpot_p50']:.2f} |")
        lines.append(f"\nOffered load {r['offered']:.0f} output tok/s (output tokens over the arrival span): an "
                     "engine near 1.00 keeps up with the arrivals, so its throughput is the arrival process's "
                     "and a ratio against it is a lower bound on the capacity ratio.")
        lines.append(f"\nThroughput ratio: **{r['ratio_transformers-cb']:.2f}x** vs continuous batching, "
                     f"{r['ratio_transformers-fixed-batch']:.2f}x vs fixed batches of {r['hf_batch']}.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="tiny,smollm2,online")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1", type=comma_separated(int),
                        help="torch thread counts, comma-separated (e.g. 1,2)")
    parser.add_argument("--online-requests", type=int, default=128)
    parser.add_argument("--online-rate", default="64,512", type=comma_separated(float),
                        help="Poisson arrivals per second, comma-separated (64: servelab keeps up with it, so its "
                             "throughput is bounded by the arrivals; 512: every engine saturated, so throughput "
                             "measures the engine)")
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--no-record", action="store_true",
                        help="print only: no rows in results.csv")
    parser.add_argument("--out", default=None, help="also write the printed report to this markdown file (the "
                        "record is the rows of results.csv: python bench/plot.py --markdown --component e2e)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = args.threads
    torch.set_num_threads(threads[0])
    names = args.workloads.split(",")
    if args.child:
        child(args.child, names[0])
        return 0
    record: list = []
    results = []
    for name in names:
        got = run_online(args, threads, record) if name == "online" else run_batch(name, args.repeats, threads, record)
        results += got
        for r in got:
            print(json.dumps(r, default=str), flush=True)
    rss = {}
    if not args.no_rss:
        for name in names:
            if name != "online":
                rss[name] = (peak_rss("servelab", name, threads[0]), peak_rss("transformers", name, threads[0]))
                for impl, value in zip(("servelab", "transformers"), rss[name]):
                    record.append(("e2e", impl, "peak_rss", "MiB", value, dict(workload=name, threads=threads[0]),
                                   None))
    text = report(results, rss, threads)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not args.no_record:
        from results_io import append_rows, make_row

        rows = []
        for component, impl, metric, unit, value, params, values in record:
            params = dict(params, omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"))
            extra = {}
            if values and len(values) > 1:
                q = statistics.quantiles(values, n=10, method="inclusive")
                extra = dict(p20=q[1], p50=statistics.median(values), p80=q[7])
            rows.append(make_row(component, impl, metric, unit, value, params=params, **extra))
        append_rows(rows)
        print(f"{len(rows)} rows appended to results.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
