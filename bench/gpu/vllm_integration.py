"""servelab pieces inside ``vllm.LLM`` on a GPU: attention backend and bridged scheduler.

Runs a small model through ``vllm.LLM`` four ways, greedy, same prompts:

1. vLLM as shipped (its default attention backend, its scheduler);
2. servelab's Triton paged attention as vLLM's ``CUSTOM`` attention backend
   (``servelab.integrations.vllm.register_attention_backend``);
3. vLLM's attention with a bridged servelab scheduler (``make_scheduler_cls("sjf")``);
4. both;
5. vLLM with servelab's host-tier offload as its KV connector
   (``servelab.integrations.vllm.kv_connector.ServelabOffloadConnector``: the
   worker side copies finished requests' blocks to host memory and loads them
   back on a prefix miss).

Checks that 2-4 produce the same tokens as 1 (greedy; a few tokens may differ
where two logits tie within float error: reported as the share of identical
outputs and the first position where each differing output diverges) and
times each run (output tokens per second, best of ``--repeats``). Prints a
table and, unless ``--no-record``, appends rows to bench/results/results.csv
(component ``vllm_integration``).

Usage::

    python bench/gpu/vllm_integration.py --model Qwen/Qwen2.5-0.5B-Instruct   # a CUDA machine with vLLM
    python bench/gpu/vllm_integration.py --cpu-smoke   # no GPU: imports, registration, class wiring only

``--cpu-smoke`` (needs vLLM's CPU classes: ``bash ci/vllm-cpu/setup.sh VENV``)
checks that the backend registers and resolves through vLLM's registry, that
the bridged scheduler runs vLLM's real scheduler for a few steps, and that the
LLM arguments this script would pass are accepted by ``EngineArgs``; it runs
no model. Without CUDA and without ``--cpu-smoke`` the script exits with
status 2 and says so. Everything runs in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the backend registration reaches
the engine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

PROMPTS = [
    "The capital of France is", "A paged KV cache stores", "Speculative decoding works by",
    "def fibonacci(n):", "The three laws of thermodynamics are", "Once upon a time, in a small village,",
    "To schedule requests fairly, a server", "The derivative of x squared is",
]


KV_OFFLOAD = {"kv_connector": "ServelabOffloadConnector",
              "kv_connector_module_path": "servelab.integrations.vllm.kv_connector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_blocks": 4096}, "kv_load_failure_policy": "recompute"}


def llm_kwargs(args, *, servelab_attention: bool, bridged_policy: str | None, kv_offload: bool = False) -> dict:
    from servelab.integrations.vllm import make_scheduler_cls

    kwargs = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
                  gpu_memory_utilization=args.gpu_memory_utilization, seed=0, max_num_seqs=args.max_num_seqs)
    if servelab_attention:
        kwargs["attention_config"] = {"backend": "CUSTOM"}
    if bridged_policy:
        kwargs["scheduler_cls"] = make_scheduler_cls(bridged_policy)
        kwargs["async_scheduling"] = False  # the bridge extends the synchronous Scheduler here
    if kv_offload:
        kwargs["kv_transfer_config"] = dict(KV_OFFLOAD)
    return kwargs


def run_variant(args, name: str, **variant) -> dict:
    import gc

    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(**llm_kwargs(args, **variant))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = PROMPTS * args.batch_multiplier
    llm.generate(prompts[:2], params)  # warm-up (compilation, autotuning)
    best, outputs = float("inf"), None
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        outputs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {"name": name, "seconds": best, "tok_s": sum(map(len, tokens)) / best, "tokens": tokens}


def compare(reference: list[list[int]], other: list[list[int]]) -> tuple[float, list[int]]:
    same = [a == b for a, b in zip(reference, other)]
    diverge = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(reference, other) if a != b]
    return sum(same) / len(same), diverge


def cpu_smoke(args) -> int:
    from servelab.integrations.vllm import make_scheduler_cls
    from servelab.integrations.vllm.attention import _smoke
    from servelab.integrations.vllm.harness import build_scheduler, make_request, model_output, tiny_model_dir
    from vllm.engine.arg_utils import EngineArgs

    info = _smoke()
    print(f"attention backend registered: {info}")
    sched = build_scheduler(make_scheduler_cls("sjf"), max_num_seqs=2)
    for i, n in enumerate((40, 8, 20)):
        sched.add_request(make_request(f"p{i}", [50 + i] * n, 3))
    steps = 0
    while sched.has_unfinished_requests() and steps < 50:
        out = sched.schedule()
        sched.update_from_output(out, model_output(sched, out))
        steps += 1
    assert not sched.has_unfinished_requests(), "the bridged scheduler did not finish its requests"
    print(f"bridged sjf scheduler: 3 requests served in {steps} steps by vLLM's {type(sched).__mro__[2].__name__}")
    args.model = tiny_model_dir()
    for variant in (dict(servelab_attention=True, bridged_policy=None), dict(servelab_attention=False,
                                                                           bridged_policy="sjf")):
        kwargs = llm_kwargs(args, **variant)
        engine_args = EngineArgs(**kwargs)
        assert engine_args.model == args.model
    engine_args = EngineArgs(**llm_kwargs(args, servelab_attention=False, bridged_policy=None, kv_offload=True))
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**KV_OFFLOAD))
    assert cls.__name__ == "ServelabOffloadConnector" and engine_args.kv_transfer_config is not None
    print("LLM arguments accepted by EngineArgs: attention_config CUSTOM, scheduler_cls bridged, "
          f"kv_transfer_config -> {cls.__module__}.{cls.__name__}")
    print("cpu smoke: OK (no model was run; run on a CUDA machine for outputs and timings)")
    return 0


def record(rows: list[dict], args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from results_io import append_rows, make_row

    import torch

    device = f"cuda:{torch.cuda.get_device_name()}"
    params = {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "batch": len(PROMPTS) * args.batch_multiplier}
    out = []
    for r in rows:
        out.append(make_row("vllm_integration", r["name"], "output_tok_s", "tok/s", r["tok_s"], params=params,
                            device=device))
        if "identical" in r:
            out.append(make_row("vllm_integration", r["name"], "greedy_identical", "fraction", r["identical"],
                                params=params, device=device))
    print(f"results: {append_rows(out)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct", help="a local folder or a HF model id")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--batch-multiplier", type=int, default=8, help="prompts = 8 x this")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--cpu-smoke", action="store_true", help="check imports and wiring on CPU; no model runs")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import torch

        if args.cpu_smoke:
            return cpu_smoke(args)
        if not torch.cuda.is_available():
            print("vllm_integration: no CUDA device; run on a GPU machine, or pass --cpu-smoke", file=sys.stderr)
            return 2
        from servelab.integrations.vllm import register_attention_backend
    except ImportError as exc:
        print(f"vllm_integration: {exc}", file=sys.stderr)
        return 2
    register_attention_backend()
    variants = [("vllm", dict(servelab_attention=False, bridged_policy=None)),
                ("servelab_attention", dict(servelab_attention=True, bridged_policy=None)),
                ("bridged_sjf", dict(servelab_attention=False, bridged_policy="sjf")),
                ("servelab_attention+bridged_sjf", dict(servelab_attention=True, bridged_policy="sjf")),
                ("servelab_kv_offload", dict(servelab_attention=False, bridged_policy=None, kv_offload=True))]
    rows = [run_variant(args, name, **v) for name, v in variants]
    print(f"\n{'variant':<34}{'tok/s':>10}{'identical':>11}  first divergence")
    failed = False
    for r in rows:
        identical, diverge = compare(rows[0]["tokens"], r["tokens"])
        r["identical"] = identical
        failed |= identical < 0.75  # ties within float error flip a few greedy tokens, not most outputs
        print(f"{r['name']:<34}{r['tok_s']:>10.0f}{identical:>11.0%}  {sorted(diverge)[:8]}")
    if not args.no_record:
        record(rows, args)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
