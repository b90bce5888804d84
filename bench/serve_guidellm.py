"""`servelab serve` against `transformers serve --continuous-batching`, driven by guidellm.

The same study as ``serve_peers.py --sweep``, with the load generator the field uses instead of
servelab's own client: guidellm (https://github.com/vllm-project/guidellm, ``pip install guidellm``)
sends the requests, measures TTFT / ITL / throughput from the streamed responses and writes its JSON
report; this script starts each server (``serve_peers._start``: the same process settings), runs
guidellm once per load point, and turns each report into rows (component ``serve``, params
``client: guidellm``).

guidellm lives in its own environment (it pins its own torch and pulls pandas/datasets; neither
belongs in servelab's): pass its executable with ``--guidellm`` (default ``.ci-venv/guidellm/bin/guidellm``).
Its tokenizer is the checkpoint's own folder (``--tokenizer kind=hf_auto,model=<folder>``): nothing is
downloaded.

Workload: guidellm's ``synthetic_text`` data (``--prompt-tokens`` tokens a prompt, sampled from its
text corpus), ``max_tokens`` = ``--max-tokens`` set by the backend. No ``output_tokens`` is given on
purpose: guidellm then sends ``ignore_eos``, which ``transformers serve`` refuses (422), so both
servers get the same plain body and stop at EOS or the cap; throughput counts the tokens each
actually generated (guidellm reads them from the usage chunk).

Load points (``--rates``): Poisson arrivals at each rate (requests/s), and ``c<N>``: N concurrent
streams, each sending its next request as the previous finishes (``c32``: saturation on this CPU).
Each point runs ``--num-requests`` requests (``max_requests`` constraint; at least 2N at ``c<N>``),
after two warm-up requests to the fresh server.

    python bench/serve_guidellm.py --rates 0.25,0.5,1,c32 --num-requests 24
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import append_rows, make_row  # noqa: E402
from serve_peers import COMPONENT, _model_name, _smollm2, _start, _stop, draw_engines  # noqa: E402

from servelab.serve.server import free_port  # noqa: E402

DEFAULT_GUIDELLM = Path(__file__).resolve().parents[1] / ".ci-venv" / "guidellm" / "bin" / "guidellm"


def _profile(point: str) -> str:
    """``"c32"`` -> 32 concurrent streams; ``"0.5"`` -> Poisson at 0.5 requests/s."""
    if point.startswith("c"):
        return f"kind=concurrent,streams={int(point[1:])}"
    rate = float(point)
    if not rate > 0:
        raise ValueError(f"--rates holds {point!r}; valid: a positive rate or c<N> (N concurrent streams)")
    return f"kind=poisson,rate={rate}"


def requests_at(point: str, num_requests: int) -> int:
    """Requests sent at a load point: ``num_requests``, and at least 2N for N concurrent streams (so
    the streams stay full for most of the run rather than draining from the start)."""
    return max(num_requests, 2 * int(point[1:])) if point.startswith("c") else num_requests


def warm_up(url: str, model: str) -> None:
    """Two short requests before the first load point (the first calls of a fresh server build
    kernels and caches: not what a load point should measure)."""
    import asyncio

    from servelab.serve.loadgen import run_rate

    warm = [{"model": model, "prompt": "Warm up: say something about caches.", "max_tokens": 8, "stream": True}
            for _ in range(2)]
    asyncio.run(run_rate(f"{url}/v1/completions", warm, float("inf")))


def run_guidellm(exe: Path, url: str, model: str, tokenizer: Path, point: str, args) -> dict:
    """One guidellm run against ``url``; its JSON report's first benchmark."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [str(exe), "run",
               "--backend", f"kind=openai_http,target={url},model={model},max_tokens={args.max_tokens}",
               "--tokenizer", f"kind=hf_auto,model={tokenizer}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens}",
               "--profile", _profile(point),
               "--constraint", f"kind=max_requests,count={requests_at(point, args.num_requests)}",
               "--seed", f"kind=static,value={args.seed}",
               "--output", f"kind=json,path={report}", "--disable-console-interactive"]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0 or not report.exists():
            raise RuntimeError(f"guidellm failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
        return json.loads(report.read_text())["benchmarks"][0]


def rows_of(engine: str, point: str, bench: dict, params: dict) -> list[dict]:
    """Rows from one guidellm benchmark: server output tokens/s, TTFT / ITL / e2e medians (seconds)."""
    m = bench["metrics"]
    ok = m["request_totals"]["successful"]
    if not ok:
        raise RuntimeError(f"{engine} at {point}: no request succeeded ({m['request_totals']})")
    out_tokens = m["output_token_count"]["successful"]["total_sum"]
    p = {**params, "rate": point, "ok": ok, "sent": requests_at(point, params["num_requests"]), "errored": m["request_totals"]["errored"],
         "duration_s": round(bench["duration"], 2), "loadavg_1m": round(os.getloadavg()[0], 2),
         "mean_output_tokens": round(out_tokens / ok, 1),
         "guidellm_output_tok_s_mean": round(m["output_tokens_per_second"]["successful"]["mean"], 2)}
    rows = [make_row(COMPONENT, engine, "output_throughput", "tok/s", out_tokens / bench["duration"], params=p)]
    for metric, key, scale in (("ttft", "time_to_first_token_ms", 1e-3), ("itl", "inter_token_latency_ms", 1e-3),
                               ("e2e", "request_latency", 1.0)):
        dist = m[key]["successful"]
        q = dist["percentiles"]
        rows.append(make_row(COMPONENT, engine, metric, "s", dist["median"] * scale,
                             params={**p, "p25": q["p25"] * scale, "p75": q["p75"] * scale},
                             p50=dist["median"] * scale))
    return rows


def plot(out: Path | None = None) -> Path:
    """Output tokens/s and TTFT p50 (p25..p75 bars) per load point, one line per engine, from the
    latest guidellm row of each (engine, point): bench/results/serve_guidellm.png."""
    from results_io import RESULTS_CSV, read_rows

    latest: dict[tuple[str, str, str], dict] = {}
    for row in read_rows(component=COMPONENT):
        if row["params"].get("client") == "guidellm" and row["metric"] in ("output_throughput", "ttft"):
            latest[(row["implementation"], row["metric"], str(row["params"]["rate"]))] = row

    def order(point: str) -> tuple[int, float]:  # Poisson rates ascending, then concurrency levels
        return (1, float(point[1:])) if point.startswith("c") else (0, float(point))

    def spread(row: dict) -> tuple[float, float]:
        return row["params"].get("p25", row["value"]), row["params"].get("p75", row["value"])

    return draw_engines(latest, order, spread, "load point (Poisson requests/s; cN = N concurrent streams)",
                        "servelab serve vs transformers serve --continuous-batching, SmolLM2-135M, CPU, guidellm client",
                        out or RESULTS_CSV.parent / "serve_guidellm.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="servelab,transformers")
    parser.add_argument("--rates", default="0.25,0.5,1,c32",
                        help="load points, comma-separated: Poisson requests/s, or c<N> concurrent streams")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--guidellm", type=Path, default=DEFAULT_GUIDELLM, help="the guidellm executable")
    parser.add_argument("--plot", action="store_true", help="only draw bench/results/serve_guidellm.png")
    args = parser.parse_args()
    if args.plot:
        print(f"plot: {plot()}")
        return
    if not args.guidellm.exists():
        sys.exit(f"no guidellm at {args.guidellm}: python -m venv .ci-venv/guidellm && "
                 f".ci-venv/guidellm/bin/pip install guidellm (or pass --guidellm PATH)")
    points = args.rates.split(",")
    for point in points:
        _profile(point)  # refuse a bad point before any server starts
    path = Path(args.model) if args.model else _smollm2()
    params = {"model": "smollm2-135m", "threads": args.threads, "num_requests": args.num_requests,
              "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens, "client": "guidellm"}
    for engine in args.engines.split(","):
        port = free_port()
        proc = _start(engine, path, port, args.threads)
        try:
            url = f"http://127.0.0.1:{port}"
            warm_up(url, _model_name(engine, path))
            for point in points:
                bench = run_guidellm(args.guidellm, url, _model_name(engine, path), path, point, args)
                rows = rows_of(engine, point, bench, params)
                append_rows(rows)
                by = {r["metric"]: r["value"] for r in rows}
                print(f"{engine:12s} {point:>6}: {by['output_throughput']:.1f} tok/s, TTFT p50 {by['ttft']:.3f} s, "
                      f"ITL p50 {by['itl'] * 1e3:.1f} ms, {json.loads(rows[0]['params'])['ok']} ok, "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
        finally:
            _stop(proc)


if __name__ == "__main__":
    main()
