"""`servelab serve` against `transformers serve --continuous-batching` on SmolLM2-135M-Instruct, one client.

Each server runs as its own process (``OMP_NUM_THREADS`` = ``--threads`` for both) on the same
checkpoint folder; the client is :mod:`servelab.serve.loadgen` (an async OpenAI streaming client that
replays guidellm's per-request measurement: TTFT at the first content chunk, ITL between chunks; output
tokens counted by re-tokenizing each answer with the model's tokenizer, so both servers are counted the
same way). guidellm itself was not used: it pulls pandas/datasets into the shared environment and wants
a Hugging Face processor download; the client here sends the same Poisson workload.

Modes (rows go to bench/results/results.csv through results_io, with the machine load):

- ``--sweep`` (default): a Poisson rate sweep (``--rates``, ``inf`` = all at once: saturation);
  per engine and rate: output tokens/s, TTFT p50 (p20/p80), ITL p50, e2e p50.
- ``--overhead``: light load (one request at a time): TTFT p50 and tokens/s through HTTP vs the same
  requests through the offline ``Pipeline`` in this process (same settings, same threads).
- ``--storm N``: the storm with N clients against an in-process server on SmolLM2; afterwards
  /metrics must show 0 running / 0 waiting / 0% KV and the pool every block free.

    python bench/serve_peers.py --sweep --rates 0.5,1,2,inf --num-requests 24
    python bench/serve_peers.py --overhead
    python bench/serve_peers.py --storm 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import append_rows, make_row, percentiles  # noqa: E402

from servelab.serve.loadgen import run_rate, run_storm  # noqa: E402
from servelab.serve.server import free_port  # noqa: E402

COMPONENT = "serve"
WORDS = ("the", "cache", "block", "token", "request", "scheduler", "prefix", "kernel", "batch", "memory")


def _smollm2() -> Path:
    from servelab.models.hub import REAL_MODELS

    fetch, _, _ = REAL_MODELS["smollm2"]
    return Path(fetch())


def _payloads(n: int, prompt_words: int, max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"model": "m", "prompt": "Write a long story about " + " ".join(rng.choice(WORDS) for _ in range(prompt_words)),
             "max_tokens": max_tokens, "temperature": 0, "stream": True}  # no ignore_eos: transformers refuses it
            for _ in range(n)]


def _start(engine: str, path: Path, port: int, threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if engine == "servelab":
        cmd = [sys.executable, "-m", "servelab.cli", "serve", str(path), "--port", str(port), "--threads",
               str(threads), "--served-model-name", "m", "--log-level", "warning"]
    else:
        cmd = [str(Path(sys.executable).with_name("transformers")), "serve", str(path), "--continuous-batching",
               "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
               # a KV cache for 64 contexts of 256 tokens: its default sizes the cache from free memory,
               # which got its model process OOM-killed on this shared machine
               "--cb-block-size", "256", "--cb-num-blocks", "68", "--cb-max-batch-tokens", "2048",
               "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{engine} server did not become healthy in 300 s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _model_name(engine: str, path: Path) -> str:
    return "m" if engine == "servelab" else str(path)


def _rows(engine: str, rate: float, results, wall: float, tokenizer, params: dict) -> list[dict]:
    ok = [r for r in results if r.status == 200 and r.ttft is not None]
    if not ok:
        raise RuntimeError(f"{engine}: no request succeeded at rate {rate}; first error: {results[0].error}")
    tokens = sum(len(tokenizer.encode(r.text, add_special_tokens=False)) for r in ok)
    load = os.getloadavg()[0]
    p = {**params, "rate": "inf" if rate == float("inf") else rate, "ok": len(ok), "sent": len(results),
         "loadavg_1m": round(load, 2), "mean_output_tokens": round(tokens / max(1, len(ok)), 1)}
    rows = [make_row(COMPONENT, engine, "output_throughput", "tok/s", tokens / wall, params=p)]
    for metric, samples in (("ttft", [r.ttft for r in ok]), ("itl", [x for r in ok for x in r.itl]),
                            ("e2e", [r.e2e for r in ok])):
        if samples:
            q = percentiles(samples)
            rows.append(make_row(COMPONENT, engine, metric, "s", q["p50"], params=p, **q))
    return rows


def sweep(args, path: Path) -> None:
    from servelab.models import load_tokenizer

    tokenizer = load_tokenizer(path)
    rates = [float(r) for r in args.rates.split(",")]
    params = {"model": "smollm2-135m", "threads": args.threads, "num_requests": args.num_requests,
              "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "client": "servelab.loadgen"}
    for engine in args.engines.split(","):
        port = free_port()
        proc = _start(engine, path, port, args.threads)
        try:
            url = f"http://127.0.0.1:{port}/v1/completions"
            warm = _payloads(2, args.prompt_words, 8, seed=99)
            for w in warm:
                w["model"] = _model_name(engine, path)
            asyncio.run(run_rate(url, warm, float("inf")))
            for rate in rates:
                payloads = _payloads(args.num_requests, args.prompt_words, args.max_tokens, seed=int(rate) if
                                     rate != float("inf") else 0)
                for pl in payloads:
                    pl["model"] = _model_name(engine, path)
                results, wall = asyncio.run(run_rate(url, payloads, rate, seed=1))
                rows = _rows(engine, rate, results, wall, tokenizer, params)
                append_rows(rows)
                by = {r["metric"]: r["value"] for r in rows}
                print(f"{engine:12s} rate {rate:>5}: {by['output_throughput']:.1f} tok/s "
                      f"({json.loads(rows[0]['params'])['mean_output_tokens']} tokens a request), TTFT p50 "
                      f"{by.get('ttft', float('nan')):.3f} s, ITL p50 {by.get('itl', float('nan')):.4f} s, "
                      f"{sum(r.status == 200 for r in results)}/{len(results)} ok, load {os.getloadavg()[0]:.2f}",
                      flush=True)
        finally:
            _stop(proc)


def overhead(args, path: Path) -> None:
    """Light load: the same requests one at a time, offline Pipeline vs HTTP (servelab serve), interleaved
    (offline, then HTTP, per request) so both see the same machine load. TTFT is the first *text* both
    ways (the first chunk with content; the first stream event with text), what a user sees."""
    import torch

    from servelab import Pipeline, SamplingParams
    from servelab.serve.loadgen import stream_request

    torch.set_num_threads(args.threads)
    payloads = _payloads(args.num_requests, args.prompt_words, args.max_tokens, seed=5)
    port = free_port()
    proc = _start("servelab", path, port, args.threads)
    pipe = Pipeline.from_pretrained(path)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    def offline_one(prompt: str) -> tuple[float, int, float]:
        start, first, tokens = time.perf_counter(), None, 0
        for event in pipe.stream([prompt], params):
            if first is None and event.new_text:
                first = time.perf_counter() - start
            tokens += len(event.new_token_ids)
        return first, tokens, time.perf_counter() - start

    async def interleaved():
        offline, http = [], []
        async with httpx.AsyncClient(timeout=600) as client:
            url = f"http://127.0.0.1:{port}/v1/completions"
            offline_one(payloads[0]["prompt"])
            await stream_request(client, url, {**payloads[0], "max_tokens": 4})
            for payload in payloads:
                offline.append(offline_one(payload["prompt"]))
                http.append(await stream_request(client, url, {**payload, "stream_options": {"include_usage": True}}))
        return offline, http

    try:
        offline, http = asyncio.run(interleaved())
    finally:
        _stop(proc)
    load = round(os.getloadavg()[0], 2)
    p = {"model": "smollm2-135m", "threads": args.threads, "num_requests": args.num_requests,
         "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "loadavg_1m": load, "concurrency": 1,
         "ttft": "first text"}
    rows = []
    for name, ttft, tokens, seconds in (
            ("pipeline-offline", [o[0] for o in offline], sum(o[1] for o in offline), sum(o[2] for o in offline)),
            ("servelab-serve-http", [r.ttft for r in http], sum(r.output_tokens for r in http),
             sum(r.e2e for r in http))):
        q = percentiles(ttft)
        rows.append(make_row(COMPONENT, name, "ttft_light_load", "s", q["p50"], params=p, **q))
        rows.append(make_row(COMPONENT, name, "throughput_light_load", "tok/s", tokens / seconds, params=p))
    ratio_ttft = rows[2]["value"] / rows[0]["value"]
    ratio_tput = rows[3]["value"] / rows[1]["value"]
    rows.append(make_row(COMPONENT, "servelab-serve-http", "http_ttft_p50_ratio", "x", ratio_ttft, params=p))
    rows.append(make_row(COMPONENT, "servelab-serve-http", "http_throughput_ratio", "x", ratio_tput, params=p))
    append_rows(rows)
    print(f"light load, {args.num_requests} requests one at a time: TTFT p50 offline {rows[0]['value'] * 1e3:.1f} ms, "
          f"HTTP {rows[2]['value'] * 1e3:.1f} ms ({ratio_ttft:.3f}x); tokens/s offline {rows[1]['value']:.1f}, "
          f"HTTP {rows[3]['value']:.1f} ({ratio_tput:.3f}x); load {load}")


def storm(args, path: Path) -> None:
    """The full storm (``args.storm`` clients) against an in-process server on SmolLM2."""
    import torch

    from servelab import Pipeline
    from servelab.serve.server import BackgroundServer

    torch.set_num_threads(args.threads)
    max_model_len = 512
    pipe = Pipeline.from_pretrained(path, max_model_len=max_model_len, num_blocks=512)
    with BackgroundServer(pipe, "m", max_waiting=4096) as server:
        report = asyncio.run(run_storm(server.root, args.storm, max_model_len=max_model_len, max_tokens=16))
        deadline = time.monotonic() + 60
        while True:
            text = httpx.get(server.root + "/metrics").text
            gauges = {k.removeprefix("servelab:"): float(v) for k, v in
                      (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}
            if not gauges["num_requests_running"] and not gauges["num_requests_waiting"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        leaked = pipe.num_blocks - 1 - pipe.kv_cache_manager.num_free_blocks
        stuck = len(pipe._tracked)
    good = report.results["good"]
    bad_ok = all(set(report.statuses[k]) == {400} for k in ("malformed", "wrong_type", "too_long"))
    load = round(os.getloadavg()[0], 2)
    p = {"model": "smollm2-135m", "clients": args.storm, "kinds": report.kinds, "loadavg_1m": load,
         "threads": args.threads, "seconds": round(report.seconds, 2)}
    rows = [make_row(COMPONENT, "servelab-serve", "storm_leaked_blocks", "blocks", leaked, params=p),
            make_row(COMPONENT, "servelab-serve", "storm_stuck_requests", "requests",
                     gauges["num_requests_running"] + gauges["num_requests_waiting"] + stuck, params=p),
            make_row(COMPONENT, "servelab-serve", "storm_kv_usage_after", "fraction", gauges["kv_cache_usage_perc"],
                     params=p),
            make_row(COMPONENT, "servelab-serve", "storm_wrong_answers", "requests", len(report.wrong_answers),
                     params=p),
            make_row(COMPONENT, "servelab-serve", "storm_good_answered", "fraction",
                     sum(r.status == 200 for r in good) / len(good), params=p)]
    append_rows(rows)
    print(f"storm of {args.storm} clients ({report.kinds}) in {report.seconds:.1f} s: statuses {report.statuses}; "
          f"after: running {gauges['num_requests_running']:.0f}, waiting {gauges['num_requests_waiting']:.0f}, KV "
          f"{gauges['kv_cache_usage_perc']:.3f}, leaked blocks {leaked}, tracked {stuck}, wrong answers "
          f"{len(report.wrong_answers)}, malformed/wrong-type/too-long all 400: {bad_ok}; load {load}")


def draw_engines(latest: dict[tuple[str, str, str], dict], order, spread, xlabel: str, title: str,
                 path: Path) -> Path:
    """Two panels (output tokens/s, TTFT p50), one line per engine over the load points of ``latest``
    (``(engine, metric, point) -> row``), points sorted by ``order(point)``, error bars from
    ``spread(row) -> (low, high)``; saved to ``path``. Shared with ``serve_guidellm.py``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, label in ((axes[0], "output_throughput", "output tokens/s"), (axes[1], "ttft", "TTFT p50 (s)")):
        for engine in sorted({k[0] for k in latest}):
            rows = sorted((r for k, r in latest.items() if k[0] == engine and k[1] == metric),
                          key=lambda r: order(str(r["params"]["rate"])))
            ys = [r["value"] for r in rows]
            bounds = [spread(r) for r in rows]
            err = [[max(0.0, y - lo) for y, (lo, _) in zip(ys, bounds)],
                   [max(0.0, hi - y) for y, (_, hi) in zip(ys, bounds)]]
            ax.errorbar([str(r["params"]["rate"]) for r in rows], ys, yerr=err, marker="o", capsize=3, label=engine)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(out: Path | None = None) -> Path:
    """Output tokens/s and TTFT p50 (p20..p80 bars) against the offered rate, one line per engine,
    from the latest sweep row of each (engine, rate): bench/results/serve_peers.png."""
    from results_io import RESULTS_CSV, read_rows

    latest: dict[tuple[str, str, str], dict] = {}
    for row in read_rows(component=COMPONENT):
        if (row["metric"] in ("output_throughput", "ttft") and "rate" in row["params"]
                and row["params"].get("client") != "guidellm"):  # guidellm's rows: serve_guidellm.py --plot
            latest[(row["implementation"], row["metric"], str(row["params"]["rate"]))] = row

    def spread(row: dict) -> tuple[float, float]:
        y = row["value"]
        return (row["p20"] if row["p20"] is not None else y, row["p80"] if row["p80"] is not None else y)

    return draw_engines(latest, lambda point: float(point), spread,
                        "offered rate (requests/s; inf = all at once)",
                        "servelab serve vs transformers serve --continuous-batching, SmolLM2-135M, CPU (loaded machine)",
                        out or RESULTS_CSV.parent / "serve_peers.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--overhead", action="store_true")
    parser.add_argument("--storm", type=int, default=0, help="clients of the storm (0: no storm)")
    parser.add_argument("--engines", default="servelab,transformers")
    parser.add_argument("--rates", default="0.5,1,2,inf", help="requests/s, comma-separated; inf: all at once")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--plot", action="store_true", help="only draw bench/results/serve_peers.png")
    args = parser.parse_args()
    if args.plot:
        print(f"plot: {plot()}")
        return
    path = Path(args.model) if args.model else _smollm2()
    if not (args.sweep or args.overhead or args.storm):
        args.sweep = True
    if args.storm:
        storm(args, path)
    if args.overhead:
        overhead(args, path)
    if args.sweep:
        sweep(args, path)


if __name__ == "__main__":
    main()
