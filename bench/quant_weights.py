"""Quantized weights study: a GGUF checkpoint run natively vs dequantized to float32, online int8 /
w4a16 on the float32 weights, and llama.cpp on the same file, in one run.

Variants (``implementation`` of the rows, ``component=quant_weights``):

- ``float32``: the ``.gguf`` dequantized at load (``quantization=None``; the same weights as the
  converted float32 folder);
- ``gguf``: the file's blocks kept (``quantization="auto"``: SmolLM2 Q4_1 + Q8_0 tied head; Gemma 3
  Q4_K_M's Q5_0 / Q4_K / Q6_K / Q8_0);
- ``int8`` / ``w4a16``: online quantization of the float32 weights (``w4a16`` with group 128 where it
  divides every width, else 32: SmolLM2's 576 takes 32);
- ``llama.cpp``: llama.cpp itself on the same file, same prompts and thread counts, greedy, in a
  fresh process through ``xllamacpp`` (prebuilt CPU wheels of llama.cpp's server, an AVX2 build:
  ``pip install xllamacpp``, bench environment only, never CI); skipped with a note when missing;
- ``llama-cpp-python`` (with ``--llama-cpp-python PYTHON``): llama.cpp built from source for this
  CPU (AVX-512, VNNI, BF16; AMX off: its AMX matmul crashed in this VM), run by an interpreter that
  has it (a bench venv: ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
  -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AMX_INT8=OFF ..." pip install llama-cpp-python``),
  the stronger anchor of the two.

Metrics: ``ppl`` / ``ppl_ratio`` / ``kl_mean`` / ``top1_agreement`` teacher-forced over real text
(``bench/data/kv_quant_text.txt``) against ``float32``; ``greedy_equal`` (of 16 demo prompts, 32
tokens); ``peak_rss`` (MiB, a fresh subprocess loading the model and generating 8 tokens);
``decode_tok_s`` at batch 1, 4 and 16 (16 tokens of prompt, 32 generated, EOS ignored) and
``prefill_tok_s`` (one 512-token prompt), at each ``--threads`` count; llama.cpp serves the 16
requests one after another (``aggregate_tok_s``), as a single-stream engine does. Every timed row
records ``os.getloadavg()`` (the machine may be shared).

Usage: ``python bench/quant_weights.py [--model smollm2|gemma3-270m] [--threads 1,2] [--parts acc,speed,rss]``;
``--plot`` draws ``bench/results/quant_weights.png`` from the recorded rows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from options import comma_separated  # noqa: E402
from results_io import append_rows, make_row  # noqa: E402
from text_accuracy import text_metrics  # noqa: E402

TEXT = Path(__file__).parent / "data" / "kv_quant_text.txt"
BATCHES = (1, 4, 16)
NEW_TOKENS = 32


def gguf_path(name: str) -> Path:
    from servelab.models import hub

    if name == "smollm2":
        return hub.fetch_smollm2_gguf()
    if name == "gemma3-270m":
        return hub.fetch_gemma3_270m_gguf()
    return Path(name)


def online_w4a16(model_name: str) -> str:
    return "w4a16-g32" if model_name == "smollm2" else "w4a16"


def build(variant: str, path: Path, model_name: str, float_model=None):
    """A pipeline of ``variant`` (online methods quantize ``float_model``, else a fresh float32 load, in place)."""
    from servelab import Pipeline

    common = {"max_num_seqs": 16, "enable_prefix_caching": False}  # every prompt computed, as llama.cpp's
    if variant == "gguf":
        return Pipeline.from_pretrained(path, **common)
    if variant == "float32":
        return Pipeline.from_pretrained(path, quantization=None, **common)
    from servelab.models import load_model, load_tokenizer

    setting = "int8" if variant == "int8" else online_w4a16(model_name)
    model = float_model if float_model is not None else load_model(path)[0]  # quantized in place
    return Pipeline(model, load_tokenizer(path), quantization=setting, **common)


@torch.no_grad()
def sequence_logits(model, tokens: list[int], block_size: int = 16) -> torch.Tensor:
    from servelab.models import allocate_kv_caches, prepare_inputs

    num_blocks = -(-len(tokens) // block_size) + 1
    caches = allocate_kv_caches(model, num_blocks, block_size)
    ids, pos, meta = prepare_inputs([tokens], [0], [list(range(1, num_blocks))], block_size)
    model.reset_attention_state()
    return model.compute_logits(model(ids, pos, caches, meta)).float()


def demo_prompts(tokenizer) -> list[list[int]]:
    from servelab.cli.demo import demo_prompts as make

    return make(tokenizer, random.Random(0), 16)


def timed_generate(pipe, prompts, max_tokens: int) -> tuple[float, int]:
    from servelab import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = pipe.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def speed_rows(pipe, variant: str, short: list[list[int]], long_prompt: list[int], threads: int, common) -> list:
    rows = []
    pipe.generate(short[:2], None)  # warm: kernels built, caches touched
    for batch in BATCHES:
        wall, tokens = timed_generate(pipe, short[:batch], NEW_TOKENS)
        load = os.getloadavg()[0]
        rows.append(make_row("quant_weights", variant, "decode_tok_s", "tok/s", tokens / wall,
                             params=dict(common, batch=batch, threads=threads, loadavg=load)))
        print(f"  {variant:9s} t={threads} batch={batch:2d} decode {tokens / wall:7.1f} tok/s (load {load:.1f})",
              flush=True)
    wall, _ = timed_generate(pipe, [long_prompt], 1)
    load = os.getloadavg()[0]
    rows.append(make_row("quant_weights", variant, "prefill_tok_s", "tok/s", len(long_prompt) / wall,
                         params=dict(common, prompt_tokens=len(long_prompt), threads=threads, loadavg=load)))
    print(f"  {variant:9s} t={threads} prefill {len(long_prompt) / wall:7.1f} tok/s", flush=True)
    return rows


def llama_server(path: Path, threads: int):
    """llama.cpp in this process: ``xllamacpp`` (prebuilt llama.cpp server bindings, CPU wheel), one
    slot, no prompt cache; ``None`` when it is not installed."""
    try:
        import xllamacpp
    except ImportError:
        return None
    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_ctx, params.n_parallel, params.n_batch = 2048, 1, 512
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    params.warmup = False
    return xllamacpp.Server(params)


def llama_complete(server, prompt: list[int], n_predict: int) -> tuple[float, dict]:
    """One greedy completion (EOS ignored, no prompt reuse): wall seconds and the response."""
    start = time.perf_counter()
    out = server.handle_completions({"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
                                     "cache_prompt": False, "ignore_eos": True})
    return time.perf_counter() - start, out


def child_json(command: list[str], label: str):
    """Run ``command`` (a fresh process), return the JSON of its last stdout line that holds one, or
    ``None`` after printing why it failed (``label``: what it measured)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as error:
        print(f"  {label}: failed ({error})", flush=True)
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith(("{", "["))]
    if done.returncode != 0 or not lines:
        print(f"  {label}: failed ({(done.stderr.strip().splitlines() or ['?'])[-1]})", flush=True)
        return None
    return json.loads(lines[-1])


LLAMA_CPP_PYTHON = r"""
import json, sys, time
import llama_cpp
path, short, long_prompt, threads, new_tokens = json.loads(sys.argv[1])
llm = llama_cpp.Llama(path, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)

def complete(prompt, n):  # greedy, EOS ignored, nothing reused from the previous prompt
    llm.reset()
    start, made = time.perf_counter(), 0
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        made += 1
        if made == n:
            break
    return time.perf_counter() - start, made

complete(short[0], 4)
walls = [complete(p, new_tokens) for p in short]
prefill = complete(long_prompt, 1)
print(json.dumps({"version": llama_cpp.__version__, "walls": walls, "prefill": prefill}))
"""


def llama_cpp_python_rows(python: str, path: Path, short: list[list[int]], long_prompt: list[int], threads: int,
                          common) -> list:
    """llama.cpp through ``llama-cpp-python`` (built from source for this CPU: AVX-512, VNNI, BF16, AMX
    off; see the module docstring), run by ``python`` (an interpreter with ``llama_cpp`` installed, e.g. a
    bench venv), one prompt after another, greedy, EOS ignored (``Llama.generate`` does not stop at it).
    Rows recorded before 2026-12-06 01:10 UTC name the engine "(GGML_NATIVE)": the same explicit-flag
    build."""
    got = child_json([python, "-c", LLAMA_CPP_PYTHON, json.dumps([str(path), short, long_prompt, threads,
                                                                   NEW_TOKENS])], f"llama-cpp-python t={threads}")
    if got is None:
        return []
    common = dict(common, engine=f"llama-cpp-python {got['version']} (source build)", threads=threads,
                  loadavg=os.getloadavg()[0])
    (wall, made), walls = got["walls"][0], got["walls"]
    aggregate = sum(m for _, m in walls) / sum(w for w, _ in walls)
    prefill = len(long_prompt) / got["prefill"][0]
    print(f"  llama-cpp-python t={threads} batch=1 decode {made / wall:7.1f} tok/s, 16 one after another "
          f"{aggregate:7.1f} tok/s, prefill {prefill:7.1f} tok/s", flush=True)
    return [make_row("quant_weights", "llama-cpp-python", "decode_tok_s", "tok/s", made / wall,
                     params=dict(common, batch=1)),
            make_row("quant_weights", "llama-cpp-python", "aggregate_tok_s", "tok/s", aggregate,
                     params=dict(common, requests=len(short), served="one after another")),
            make_row("quant_weights", "llama-cpp-python", "prefill_tok_s", "tok/s", prefill,
                     params=dict(common, prompt_tokens=len(long_prompt)))]


def llama_cpp_rows(path: Path, short: list[list[int]], long_prompt: list[int], threads: int, common) -> list:
    """llama.cpp's rows, measured in a fresh process: in this one, after torch ran at 2 threads,
    llama.cpp's 2-thread decode fell from 77.7 to 36.6 tok/s (the two thread pools fight for the
    cores), which would flatter servelab."""
    got = child_json([sys.executable, __file__, "--llama-child", json.dumps([str(path), short, long_prompt, threads,
                                                                           common])], f"llama.cpp t={threads}")
    if got is None:
        return []
    rows, summary = got
    print(summary, flush=True)
    return rows


def llama_cpp_child(args_json: str) -> None:
    path, short, long_prompt, threads, common = json.loads(args_json)
    print(json.dumps(llama_cpp_measure(Path(path), short, long_prompt, threads, common)), flush=True)  # [rows, summary]


def llama_cpp_measure(path: Path, short: list[list[int]], long_prompt: list[int], threads: int, common) -> list:
    """``[rows, summary line]`` of xllamacpp on the prompts (run in a child: :func:`llama_cpp_rows`)."""
    server = llama_server(path, threads)
    if server is None:
        return [[], "  llama.cpp: pip install xllamacpp (bench environment only); skipped"]
    import xllamacpp

    common = dict(common, engine=f"xllamacpp {getattr(xllamacpp, '__version__', '')}".strip())
    llama_complete(server, short[0], 4)  # warm
    walls = [llama_complete(server, p, NEW_TOKENS) for p in short]
    load = os.getloadavg()[0]
    wall, first = walls[0]
    made = first["usage"]["completion_tokens"]
    rows = [make_row("quant_weights", "llama.cpp", "decode_tok_s", "tok/s", made / wall,
                     params=dict(common, batch=1, threads=threads, loadavg=load,
                                 llama_predicted_per_second=first["timings"]["predicted_per_second"]))]
    total = sum(w for w, _ in walls)
    tokens = sum(o["usage"]["completion_tokens"] for _, o in walls)
    rows.append(make_row("quant_weights", "llama.cpp", "aggregate_tok_s", "tok/s", tokens / total,
                         params=dict(common, requests=len(short), threads=threads, loadavg=load,
                                     served="one after another")))
    wall, out = llama_complete(server, long_prompt, 1)
    rows.append(make_row("quant_weights", "llama.cpp", "prefill_tok_s", "tok/s", len(long_prompt) / wall,
                         params=dict(common, prompt_tokens=len(long_prompt), threads=threads,
                                     loadavg=os.getloadavg()[0],
                                     llama_prompt_per_second=out["timings"]["prompt_per_second"])))
    summary = (f"  llama.cpp t={threads} batch=1 decode {made / walls[0][0]:7.1f} tok/s, 16 one after another "
               f"{tokens / total:7.1f} tok/s, prefill {len(long_prompt) / wall:7.1f} tok/s")
    del server
    return [rows, summary]


def rss_child(variant: str, path: Path, model_name: str) -> None:
    """Runs in a fresh process: load ``variant``, generate 8 tokens, print peak RSS (MiB)."""
    torch.set_num_threads(1)
    if variant == "llama.cpp":
        llama_complete(llama_server(path, 1), [1, 504, 3458], 8)
    else:
        from servelab import SamplingParams

        pipe = build(variant, path, model_name)
        pipe.generate(["The cache"], SamplingParams(temperature=0, max_tokens=8))
    print(json.dumps({"peak_rss_mib": peak_rss_mib()}))


def peak_rss_mib() -> float:
    """This process's peak resident set since its ``exec`` (``VmHWM``). Not ``ru_maxrss``: Linux keeps
    that across ``exec``, so a child forked from a parent holding 18 GB reported 18 GB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_rows(path: Path, model_name: str, variants: list[str], common) -> list:
    rows = []
    for variant in variants:
        got = child_json([sys.executable, __file__, "--model", model_name, "--rss-child", variant], f"rss {variant}")
        if got is None:
            continue
        mib = got["peak_rss_mib"]
        rows.append(make_row("quant_weights", variant, "peak_rss", "MiB", mib, params=dict(common, rss="VmHWM")))
        print(f"  {variant:9s} peak RSS {mib:7.0f} MiB", flush=True)
    return rows


def plot(out: Path = Path(__file__).parent / "results" / "quant_weights.png") -> Path:
    """Latest 1-thread decode tok/s per variant and batch (llama.cpp: batch 1 and its 16 requests one
    after another) and peak RSS, from ``results.csv``, as two panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from results_io import read_rows

    rows = [r for r in read_rows(component="quant_weights") if r["params"].get("model") == "smollm2"]
    latest: dict[tuple, float] = {}
    for r in rows:
        params = r["params"]
        if r["metric"] == "decode_tok_s" and params.get("threads") == 1 and params.get("batch") in BATCHES:
            latest[(r["implementation"], params["batch"])] = r["value"]
        elif r["metric"] == "aggregate_tok_s" and params.get("threads") == 1:
            latest[(r["implementation"], 16)] = r["value"]
        elif r["metric"] == "peak_rss" and params.get("rss") == "VmHWM":  # earlier rows: ru_maxrss (see peak_rss_mib)
            latest[(r["implementation"], "rss")] = r["value"]
    variants = ["float32", "gguf", "int8", "w4a16", "llama.cpp", "llama-cpp-python"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, variant in enumerate(variants):
        values = [latest.get((variant, b), 0.0) for b in BATCHES]
        left.bar([x + 0.13 * i for x in range(len(BATCHES))], values, width=0.13, label=variant)
        right.bar(i, latest.get((variant, "rss"), 0.0))
    left.set_xticks([x + 0.32 for x in range(len(BATCHES))], [f"batch {b}" for b in BATCHES])
    left.set_ylabel("decode tok/s, 1 thread")
    left.set_title("llama.cpp at batch 16: the 16 served one after another", fontsize=9)
    left.legend(fontsize=8)
    right.set_xticks(range(len(variants)), variants, rotation=20, fontsize=8)
    right.set_ylabel("peak RSS (MiB)")
    fig.suptitle("SmolLM2-135M Q4_1: native blocks vs float32 vs online vs llama.cpp (latest rows, 1 thread)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=comma_separated(int), default=[1, 2])
    parser.add_argument("--parts", default="acc,speed,rss")
    parser.add_argument("--text-tokens", type=int, default=2048)
    parser.add_argument("--variants", default="float32,gguf,int8,w4a16", help="servelab variants (with float32)")
    parser.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--llama-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--llama-cpp-python", default=None, metavar="PYTHON",
                        help="also run llama-cpp-python with this interpreter (one where llama_cpp is installed)")
    parser.add_argument("--plot", action="store_true", help="only draw results/quant_weights.png from the CSV")
    args = parser.parse_args()
    if args.plot:
        print(plot())
        return 0
    if args.llama_child:
        llama_cpp_child(args.llama_child)
        return 0
    path = gguf_path(args.model)
    if args.rss_child:
        rss_child(args.rss_child, path, args.model)
        return 0
    from servelab import SamplingParams

    parts = set(args.parts.split(","))
    common = {"model": args.model, "file": path.name}
    torch.set_num_threads(1)
    variants = [v for v in ("float32", "gguf", "int8", "w4a16") if v in args.variants.split(",")]
    if "float32" not in variants:
        raise SystemExit(f"--variants {args.variants!r} must include float32 (the baseline)")
    rows: list = []
    if parts == {"rss"}:
        append_rows(rss_rows(path, args.model, variants + ["llama.cpp"], common))
        return 0
    pipes = {"float32": build("float32", path, args.model)}
    for variant in variants[1:]:
        pipes[variant] = build(variant, path, args.model)
    print({v: repr(p.config.quantization)[:200] for v, p in pipes.items()}, flush=True)
    tokenizer = pipes["float32"].tokenizer
    prompts = demo_prompts(tokenizer)
    if "acc" in parts:
        ids = tokenizer.encode(TEXT.read_text())[:args.text_tokens + 1]
        seqs = [ids[i:i + 256] for i in range(0, len(ids) - 1, 256) if len(ids[i:i + 256]) > 16]
        logits = {v: [sequence_logits(p.model, s) for s in seqs] for v, p in pipes.items()}
        greedy = SamplingParams(temperature=0, max_tokens=32)
        outs = {v: [o.token_ids for o in p.generate(prompts, greedy)] for v, p in pipes.items()}
        base = text_metrics(logits["float32"], logits["float32"], seqs)
        for variant in variants:
            m = text_metrics(logits["float32"], logits[variant], seqs)
            equal = sum(a == b for a, b in zip(outs[variant], outs["float32"]))
            params = dict(common, text_tokens=sum(len(s) - 1 for s in seqs), seq_len=256)
            for metric, unit, value in (("ppl", "ppl", m["ppl"]), ("ppl_ratio", "ratio", m["ppl"] / base["ppl"]),
                                        ("kl_mean", "nats", m["kl_mean"]), ("top1_agreement", "fraction", m["top1_agreement"])):
                rows.append(make_row("quant_weights", variant, metric, unit, value, params=params))
            rows.append(make_row("quant_weights", variant, "greedy_equal", "prompts", equal,
                                 params=dict(common, prompts=16, max_tokens=32)))
            print(f"{variant:9s} ppl={m['ppl']:.4f} ratio={m['ppl'] / base['ppl']:.5f} kl={m['kl_mean']:.2e} "
                  f"top1={m['top1_agreement']:.4f} greedy={equal}/16", flush=True)
    if "speed" in parts:
        # 16 tokens each (a model without a chat template gets text prompts: encoded here, its BOS included)
        short = [(tokenizer.encode(p) if isinstance(p, str) else list(p))[:16] for p in prompts]
        long_prompt = tokenizer.encode(TEXT.read_text())[:512]
        for threads in args.threads:
            torch.set_num_threads(threads)
            for variant in variants:
                rows += speed_rows(pipes[variant], variant, short, long_prompt, threads, common)
            rows += llama_cpp_rows(path, short, long_prompt, threads, common)
            if args.llama_cpp_python:
                rows += llama_cpp_python_rows(args.llama_cpp_python, path, short, long_prompt, threads, common)
        torch.set_num_threads(1)
    if "rss" in parts:
        del pipes
        rows += rss_rows(path, args.model, variants + ["llama.cpp"], common)
    append_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
