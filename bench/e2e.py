"""End-to-end on CPU: servelab's Pipeline vs transformers' batched ``generate``, same process.

Workloads (``--workloads``, comma-separated):

- ``tiny``: a random tiny Llama (hidden 256, 4 layers), 16 prompts of 8-64
  tokens x 32 new tokens, greedy, float32;
- ``smollm2``: SmolLM2-135M-Instruct when its converted folder exists
  (:func:`servelab.models.hub.fetch_smollm2`), else a random checkpoint with
  its shapes (hidden 576, 30 layers, GQA 9/3, vocabulary 49,152); 16 prompts
  of 36-264 tokens x 64 new tokens, greedy, float32;
- ``online``: a heterogeneous online workload on the tiny model: 128 requests,
  Poisson arrivals, prompt and output lengths lognormal. servelab serves them
  as they arrive (continuous batching) and reports TTFT / TPOT; transformers
  runs them the way its users would, in fixed batches of ``--hf-batch`` in
  arrival order, each batch started once its last request has arrived and the
  previous batch is done (a streamer gives its TTFT / TPOT).

For the two batch workloads every repeat runs servelab then transformers
back to back (medians over ``--repeats``; the machine may be shared, so only
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

Threads: ``torch.set_num_threads(--threads)``, default 1, for both engines
(on a shared 2-core machine one thread gives stable numbers; torch's default
of one thread per core was slower for both engines when another process
shared the CPU).

    python bench/e2e.py                             # all workloads; rows into bench/results/results.csv
    python bench/e2e.py --workloads tiny --repeats 5
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from profile_step import build, workload  # noqa: E402 (bench/ is sys.path[0] when run as a script)

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


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def make_pipeline(path: Path, max_num_seqs: int, max_model_len: int):
    from servelab import Pipeline

    return Pipeline.from_pretrained(path, attention_backend="sdpa", max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=2048, max_model_len=max_model_len,
                                    enable_prefix_caching=False)


def hf_generate(model, prompts: list[list[int]], max_tokens: int, streamer=None) -> list[list[int]]:
    """Left-padded batched greedy generate of exactly ``max_tokens`` tokens per prompt."""
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, streamer=streamer)
    return [row[longest:].tolist() for row in out]


def batch_prompts(name: str, vocab: int) -> tuple[list[list[int]], int]:
    spec = BATCH[name]
    return workload(spec["num_prompts"], *spec["prompt"], min(vocab, 500), seed=0), spec["max_tokens"]


def run_batch(name: str, repeats: int, record: list) -> dict:
    from servelab.samplers import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path, what = checkpoint(name, Path(tmp))
        hf = load_hf(path)
        prompts, max_tokens = batch_prompts(name, hf.config.vocab_size)
        pipe = make_pipeline(path, len(prompts), max(map(len, prompts)) + max_tokens + 16)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pipe.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    hf_generate(hf, prompts[:2], 2)
    n_out = len(prompts) * max_tokens
    ours_tps, hf_tps, ours_cpu, hf_cpu, same = [], [], [], [], 0
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        outs = pipe.generate(prompts, params, detokenize=False)
        ours_tps.append(n_out / (time.perf_counter() - start))
        ours_cpu.append(time.process_time() - cpu)
        start, cpu = time.perf_counter(), time.process_time()
        theirs = hf_generate(hf, prompts, max_tokens)
        hf_tps.append(n_out / (time.perf_counter() - start))
        hf_cpu.append(time.process_time() - cpu)
        same = sum(o.token_ids == t for o, t in zip(outs, theirs))
    result = dict(workload=name, model=what, prompts=len(prompts), max_tokens=max_tokens,
                  servelab_tps=statistics.median(ours_tps), hf_tps=statistics.median(hf_tps), same=same,
                  servelab_all=ours_tps, hf_all=hf_tps)
    result["ratio"] = result["servelab_tps"] / result["hf_tps"]
    result["cpu_ratio"] = statistics.median(hf_cpu) / statistics.median(ours_cpu)
    params_row = dict(workload=name, model=what, prompts=len(prompts), max_tokens=max_tokens)
    for impl, values in (("servelab", ours_tps), ("transformers", hf_tps)):
        record.append(("e2e", impl, "output_throughput", "tok/s", statistics.median(values), params_row, values))
    record.append(("e2e", "servelab", "throughput_ratio_vs_transformers", "ratio", result["ratio"], params_row, None))
    record.append(("e2e", "servelab", "cpu_time_ratio_vs_transformers", "ratio", result["cpu_ratio"], params_row,
                   None))
    return result


# ---- online workload --------------------------------------------------------------------------

def online_requests(n: int, rate: float, seed: int, vocab: int) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt ids, output tokens): Poisson arrivals; lognormal lengths
    (prompt median 48, output median 32, sigma 0.8; clipped to [4, 512] / [2, 256])."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        plen = min(max(int(rng.lognormvariate(math.log(48), 0.8)), 4), 512)
        olen = min(max(int(rng.lognormvariate(math.log(32), 0.8)), 2), 256)
        out.append((t, [rng.randrange(3, min(vocab, 500)) for _ in range(plen)], olen))
    return out


def _latency_stats(arrival, first, last, lengths) -> dict:
    ttft = [f - a for a, f in zip(arrival, first)]
    tpot = [(l_ - f) / (n - 1) for f, l_, n in zip(first, last, lengths) if n > 1]
    return dict(ttft_p50=statistics.median(ttft), ttft_p90=statistics.quantiles(ttft, n=10)[8],
                tpot_p50=statistics.median(tpot), throughput=sum(lengths) / (max(last) - min(arrival)))


def serve_online_servelab(pipe, requests) -> dict:
    from servelab.samplers import SamplingParams

    start = time.perf_counter()
    pending = list(range(len(requests)))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    index: dict[str, int] = {}
    while pending or pipe.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and requests[pending[0]][0] <= now:
            i = pending.pop(0)
            _, prompt, olen = requests[i]
            rid = pipe.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True),
                                   detokenize=False)
            index[rid] = i
        if not pipe.has_unfinished_requests():
            time.sleep(max(requests[pending[0]][0] - now, 0.0))
            continue
        for event in pipe.step():
            stamp = time.perf_counter() - start
            if event.new_token_ids:
                first.setdefault(event.request_id, stamp)
                last[event.request_id] = stamp
    order = sorted(index, key=index.get)
    return _latency_stats([requests[index[r]][0] for r in order], [first[r] for r in order],
                          [last[r] for r in order], [requests[index[r]][2] for r in order])


class _Stamps:
    """A transformers streamer recording when each generation step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def serve_online_hf(model, requests, batch_size: int) -> dict:
    start = time.perf_counter()
    arrival, first, last, lengths = [], [], [], []
    for b in range(0, len(requests), batch_size):
        chunk = requests[b:b + batch_size]
        wait = chunk[-1][0] - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        stamps = _Stamps()
        hf_generate(model, [p for _, p, _ in chunk], max(o for _, _, o in chunk), streamer=stamps)
        for a, _, olen in chunk:
            arrival.append(a)
            first.append(stamps.times[0] - start)
            last.append(stamps.times[olen - 1] - start)
            lengths.append(olen)
    return _latency_stats(arrival, first, last, lengths)


def run_online(args, record: list) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path, what = checkpoint("tiny", Path(tmp))
        hf = load_hf(path)
        requests = online_requests(args.online_requests, args.online_rate, 0, hf.config.vocab_size)
        pipe = make_pipeline(path, 64, 512 + 256 + 16)
    runs = {"servelab": [], "transformers": []}
    for _ in range(args.repeats):
        runs["servelab"].append(serve_online_servelab(pipe, requests))
        runs["transformers"].append(serve_online_hf(hf, requests, args.hf_batch))
    result = dict(workload="online", model=what, requests=len(requests), rate=args.online_rate,
                  hf_batch=args.hf_batch)
    params_row = dict(workload="online", model=what, requests=len(requests), rate=args.online_rate,
                      hf_batch=args.hf_batch)
    for impl, stats in runs.items():
        for key, unit in (("throughput", "tok/s"), ("ttft_p50", "s"), ("ttft_p90", "s"), ("tpot_p50", "s")):
            values = [s[key] for s in stats]
            result[f"{impl}_{key}"] = statistics.median(values)
            record.append(("e2e", impl, key, unit, result[f"{impl}_{key}"], params_row, values))
    result["ratio"] = result["servelab_throughput"] / result["transformers_throughput"]
    record.append(("e2e", "servelab", "throughput_ratio_vs_transformers", "ratio", result["ratio"], params_row, None))
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


def report(results: list[dict], rss: dict, threads: int) -> str:
    import datetime
    import platform

    lines = [f"# End-to-end on CPU ({datetime.date.today()}, {platform.machine()}, {threads} torch thread(s), "
             f"torch {torch.__version__})", "",
             "| workload | model | servelab tok/s | transformers tok/s | ratio (wall) | ratio (CPU time) | "
             "identical outputs | peak RSS servelab / transformers (MiB) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["workload"] == "online":
            continue
        mem = rss.get(r["workload"])
        mem_text = f"{mem[0]:.0f} / {mem[1]:.0f}" if mem else "-"
        lines.append(f"| {r['prompts']} prompts x {r['max_tokens']} tokens ({r['workload']}) | {r['model']} | "
                     f"{r['servelab_tps']:.1f} | {r['hf_tps']:.1f} | **{r['ratio']:.2f}x** | {r['cpu_ratio']:.2f}x | "
                     f"{r['same']}/{r['prompts']} | {mem_text} |")
    for r in results:
        if r["workload"] != "online":
            continue
        lines += ["", f"Online: {r['requests']} requests, Poisson {r['rate']}/s, lognormal lengths, {r['model']}; "
                  f"transformers in fixed batches of {r['hf_batch']}.", "",
                  "| engine | throughput tok/s | TTFT p50 s | TTFT p90 s | TPOT p50 ms |", "|---|---|---|---|---|"]
        for impl in ("servelab", "transformers"):
            lines.append(f"| {impl} | {r[f'{impl}_throughput']:.1f} | {r[f'{impl}_ttft_p50']:.3f} | "
                         f"{r[f'{impl}_ttft_p90']:.3f} | {1e3 * r[f'{impl}_tpot_p50']:.2f} |")
        lines.append(f"\nThroughput ratio: **{r['ratio']:.2f}x**.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="tiny,smollm2,online")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--online-requests", type=int, default=128)
    parser.add_argument("--online-rate", type=float, default=64.0,
                        help="Poisson arrivals per second (64: above capacity, so throughput measures the engine)")
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--no-record", action="store_true",
                        help="print only: no rows in results.csv")
    parser.add_argument("--out", default=None, help="also write the printed report to this markdown file (the "
                        "record is the rows of results.csv: python bench/plot.py --markdown --component e2e)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.workloads.split(",")
    if args.child:
        child(args.child, names[0])
        return 0
    record: list = []
    results = []
    for name in names:
        results.append(run_online(args, record) if name == "online" else run_batch(name, args.repeats, record))
        print(json.dumps({k: v for k, v in results[-1].items()}, default=str), flush=True)
    rss = {}
    if not args.no_rss:
        for name in names:
            if name != "online":
                rss[name] = (peak_rss("servelab", name, args.threads), peak_rss("transformers", name, args.threads))
                for impl, value in zip(("servelab", "transformers"), rss[name]):
                    record.append(("e2e", impl, "peak_rss", "MiB", value, dict(workload=name), None))
    text = report(results, rss, args.threads)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not args.no_record:
        from results_io import append_rows, make_row

        rows = []
        for component, impl, metric, unit, value, params, values in record:
            params = dict(params, threads=args.threads)
            extra = {}
            if values and len(values) > 1:
                q = statistics.quantiles(values, n=10, method="inclusive")
                extra = dict(p20=q[1], p50=statistics.median(values), p80=q[7])
            rows.append(make_row(component, impl, metric, unit, value, params=params, **extra))
        append_rows(rows)
        print(f"{len(rows)} rows appended to results.csv; report in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
