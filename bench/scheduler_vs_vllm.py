"""Scheduler overhead: servelab's ``Scheduler`` vs vLLM's on the same workload.

Workload (both sides identical): ``--num-requests`` requests (default 1024),
each ``--prompt-len`` prompt tokens (default 256: a 64-token system prompt
shared by groups of requests, then unique tokens) and ``--output-len`` output
tokens (default 64, ended by ``max_tokens``); all arrive at once; prefix
caching on; chunked prefill on; ``max_num_seqs`` = all requests,
``max_num_batched_tokens`` 8192; enough KV blocks that nothing is preempted.
The fake model returns one token per request whose prefill has reached the
end of its tokens, nothing for a partial prefill.

Only ``schedule()`` and ``update_from_output()`` are timed (the fake model
and request construction are not); the figure is steps per second over the
whole run. The table shows the best of ``--repeats``; one row per
implementation (``servelab``, ``vllm``) with the median as ``value`` and
p20/p50/p80 over the repeats is appended to ``bench/results/results.csv``
(component ``scheduler``, metric ``steps_per_s``).

Usage::

    python bench/scheduler_vs_vllm.py --vllm-python /path/to/vllm-venv/bin/python
    python bench/scheduler_vs_vllm.py --num-requests 32 --repeats 1 --no-record   # smoke run

vLLM (a CPU install) runs in a subprocess of that interpreter (with
``VLLM_TARGET_DEVICE=cpu``) through this same file; without it, and when vLLM
is not importable here, its column is skipped with a message. vLLM's
``ModelConfig`` wants a model folder: a tiny Llama ``config.json``
(:data:`TINY_LLAMA_CONFIG`) is written to a temporary folder for it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK_SIZE = 16
MAX_BATCHED = 8192
SHARED_PREFIX = 64
NUM_PREFIXES = 8
TOKEN = 7  # what the fake model samples: never EOS (2) in the tiny config
# Only the scheduler is exercised; the model config just has to load (no weights are read).
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def make_prompts(num_requests: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 32000) for _ in range(SHARED_PREFIX)] for _ in range(NUM_PREFIXES)]
    return [prefixes[i % NUM_PREFIXES] + [rng.randrange(10, 32000) for _ in range(prompt_len - SHARED_PREFIX)]
            for i in range(num_requests)]


def num_blocks_for(num_requests: int, prompt_len: int, output_len: int) -> int:
    return num_requests * (-(-(prompt_len + output_len) // BLOCK_SIZE) + 1) + 64


def drive(sched, make_output) -> dict:
    """Run ``sched`` to completion with a fake model (one token per request
    whose prefill reached its end); time only ``schedule`` and
    ``update_from_output``. Both schedulers share these method names;
    ``make_output(ids, sampled)`` builds each one's own ``ModelRunnerOutput``."""
    steps, elapsed, max_running = 0, 0.0, 0
    requests = sched.requests
    while sched.has_unfinished_requests():
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        ids = list(out.num_scheduled_tokens)
        sampled = [[TOKEN] if requests[r].num_computed_tokens >= requests[r].num_tokens else [] for r in ids]
        model_out = make_output(ids, sampled)
        max_running = max(max_running, len(ids))
        t2 = time.perf_counter()
        sched.update_from_output(out, model_out)
        elapsed += (t1 - t0) + (time.perf_counter() - t2)
        steps += 1
    return {"steps": steps, "seconds": elapsed, "steps_per_s": steps / elapsed, "max_batch": max_running}


def bench_servelab(num_requests: int, prompt_len: int, output_len: int, repeats: int) -> dict:
    from servelab.blocks import FullAttentionSpec, KVCacheManager
    from servelab.samplers.params import SamplingParams
    from servelab.scheduling import ModelRunnerOutput, Request, Scheduler, SchedulerConfig

    prompts = make_prompts(num_requests, prompt_len)
    params = SamplingParams(max_tokens=output_len)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=4, head_size=64, dtype="float32")
    results = []
    for _ in range(repeats):
        kv = KVCacheManager(spec, num_blocks_for(num_requests, prompt_len, output_len), enable_caching=True)
        config = SchedulerConfig(max_num_batched_tokens=MAX_BATCHED, max_num_seqs=num_requests,
                                 max_model_len=4096)
        sched = Scheduler(config, kv, "fcfs")
        for i, p in enumerate(prompts):
            sched.add_request(Request(f"r{i}", p, params, eos_token_id=2, arrival_time=0.0))
        results.append(drive(sched, lambda ids, sampled: ModelRunnerOutput(ids, sampled)))
    return summarize(results)


def summarize(results: list[dict]) -> dict:
    """The best repeat, plus every repeat's steps/s under ``"all_steps_per_s"``."""
    best = max(results, key=lambda r: r["steps_per_s"])
    return dict(best, all_steps_per_s=[r["steps_per_s"] for r in results])


def bench_vllm(num_requests: int, prompt_len: int, output_len: int, repeats: int) -> dict:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)
    prompts = make_prompts(num_requests, prompt_len)
    num_blocks = num_blocks_for(num_requests, prompt_len, output_len)
    config_dir = tempfile.mkdtemp(prefix="tiny-llama-config-")
    (Path(config_dir) / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    model_config = ModelConfig(model=config_dir, skip_tokenizer_init=True, dtype="float32", seed=0,
                               max_model_len=4096)
    sched_config = SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=MAX_BATCHED,
                                   max_model_len=4096, is_encoder_decoder=False, enable_chunked_prefill=True)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=True)
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(scheduler_config=sched_config, model_config=model_config, cache_config=cache_config)
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=4, head_size=64,
                                                      dtype=torch.float32))])
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    results = []
    for _ in range(repeats):
        sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_config,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=BLOCK_SIZE, log_stats=True)
        for i, p in enumerate(prompts):
            sched.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=output_len), None, arrival_time=0.0,
                                      block_hasher=hasher))
        results.append(drive(sched, lambda ids, sampled: ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled)))
    return summarize(results)


def record(results: dict[str, dict], args) -> None:
    """One ``steps_per_s`` row per implementation into bench/results/results.csv
    (the vLLM row carries the versions of the interpreter that ran it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results_io import append_rows, make_row, percentiles, versions_of_python

    params = {"num_requests": args.num_requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
              "max_num_batched_tokens": MAX_BATCHED, "prefix_caching": True}
    vllm_versions = versions_of_python(args.vllm_python or sys.executable) if "vllm" in results else {}
    rows = []
    for impl, r in results.items():
        q = percentiles(r["all_steps_per_s"])
        rows.append(make_row("scheduler", impl, "steps_per_s", "steps/s", q["p50"], params=params, **q,
                             extra_versions=vllm_versions if impl == "vllm" else None))
    print(f"results: {append_rows(rows)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="python of an environment where vllm imports")
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--no-record", action="store_true", help="do not append rows to results.csv")
    parser.add_argument("--only", choices=["servelab", "vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prompt_len <= SHARED_PREFIX:
        parser.error(f"--prompt-len must exceed the {SHARED_PREFIX}-token shared prefix")
    work = (args.num_requests, args.prompt_len, args.output_len, args.repeats)
    if args.only:
        print(json.dumps((bench_servelab if args.only == "servelab" else bench_vllm)(*work)))
        return 0

    ours = bench_servelab(*work)
    theirs, note = None, ""
    try:
        import vllm  # noqa: F401

        theirs = bench_vllm(*work)
    except ImportError:
        if args.vllm_python:
            env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
            cmd = [args.vllm_python, __file__, "--only", "vllm", "--num-requests", str(args.num_requests),
                   "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
                   "--repeats", str(args.repeats)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            theirs = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            note = "vLLM is not importable here; pass --vllm-python (an environment with vLLM). Skipped."

    print(f"workload: {args.num_requests} requests x ({args.prompt_len} prompt + {args.output_len} output) "
          f"tokens, prefix caching on, {MAX_BATCHED} tokens/step, fake model")
    print(f"{'scheduler':<10}{'steps':>7}{'seconds':>10}{'steps/s':>10}{'max batch':>11}")
    for name, r in (("servelab", ours), ("vLLM", theirs)):
        if r:
            print(f"{name:<10}{r['steps']:>7}{r['seconds']:>10.3f}{r['steps_per_s']:>10.1f}{r['max_batch']:>11}")
    if theirs:
        print(f"ratio servelab/vLLM steps/s: {ours['steps_per_s'] / theirs['steps_per_s']:.2f}")
    if note:
        print(note)
    if not args.no_record:
        record({"servelab": ours, **({"vllm": theirs} if theirs else {})}, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"servelab": ours, "vllm": theirs, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
