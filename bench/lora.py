"""Many LoRA adapters on one base model: throughput as the number of distinct adapters in
the batch grows, against the base model alone, weights merged for one adapter, and serving
the adapters one after another; the cost of loading and activating an adapter.

One workload (``--requests`` prompts of ``--prompt-len`` random tokens, ``--max-tokens``
greedy tokens each, ignore_eos) is run as:

- ``base``: the model without LoRA (``enable_lora=False``);
- ``merged``: one adapter's ``B @ A * scaling`` added into the weights, no LoRA at run time;
- ``lora``: ``enable_lora=True``, the requests spread round-robin over ``k`` adapters
  (``--adapters``, default 1,2,4,8,16) with ``max_loras`` = ``k`` and ``k // 2`` (slots below
  the adapter count: the scheduler's constraint and slot evictions show);
- ``sequential``: the same ``k`` adapters served one after another (one ``generate`` per
  adapter, its requests only, ``max_loras=1``).

Each round runs every configuration once (after one warm-up run each); rows hold the median
over rounds (p20/p80 the spread) of output tokens per second, and the ratios taken within a
round: ``lora`` over ``base`` and ``lora`` over ``sequential`` (the issue's targets: >= 0.7 and
>= 4 at 8 adapters). ``load_ms`` / ``activate_ms``: reading an adapter folder, and writing it
into a slot of every wrapped layer. Every timed configuration also records ``load_1m``
(``os.getloadavg()``): the machine may be shared.

Adapters are written in PEFT's format directly (random A, B; rank ``--rank``; q/k/v/o and
gate/up/down), which is what ``peft``'s ``save_pretrained`` writes.

Usage: ``python bench/lora.py [--model smollm2] [--adapters 1,2,4,8,16] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from options import comma_separated  # noqa: E402
from results_io import append_rows, make_row, percentiles  # noqa: E402

from servelab import Pipeline, SamplingParams  # noqa: E402
from servelab.lora import LoRARequest  # noqa: E402
from servelab.lora.peft import load_peft_adapter  # noqa: E402
from servelab.models import build_tiny_model, load_config, load_model, load_tokenizer  # noqa: E402
from servelab.models.layer_api import linear_layers, output_slices  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_path(name: str, root: Path) -> Path:
    if name == "smollm2":
        from servelab.models import hub
        return hub.fetch_smollm2()
    if name == "tiny":
        return build_tiny_model(root / "tiny", num_hidden_layers=4, hidden_size=128, intermediate_size=256)
    return Path(name)


def write_adapter(folder: Path, base: Path, *, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter folder for ``base`` (every decoder projection, random A and B)."""
    from safetensors.torch import save_file

    model, _ = load_model(base, pack_weights=False)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, layer in linear_layers(model):
        if ".layers." not in name:
            continue
        prefix = name.rpartition(".")[0]
        for part in output_slices(layer, name.rpartition(".")[2]):
            key = f"base_model.model.{prefix}.{part.name}"
            fan_in = layer.in_features
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(part.size, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=MODULES, bias="none")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def merged_model(base: Path, adapter: LoRARequest, max_rank: int):
    """The base model with ``adapter`` merged into its weights (no LoRA at run time)."""
    model, _ = load_model(base)
    modules = {}
    for name, layer in linear_layers(model):
        for part in output_slices(layer, name.rpartition(".")[2]):
            modules[f"{name.rpartition('.')[0]}.{part.name}"] = (layer.in_features, part.size)
    loaded = load_peft_adapter(adapter, max_rank=max_rank, modules=modules)
    with torch.no_grad():
        for name, layer in linear_layers(model):
            for part in output_slices(layer, name.rpartition(".")[2]):
                pair = loaded.weights.get(f"{name.rpartition('.')[0]}.{part.name}")
                if pair is not None:
                    layer.weight[part.start:part.start + part.size] += (pair[1] @ pair[0]).to(layer.weight.dtype)
    return model


def timed(pipe: Pipeline, prompts, params, loras=None) -> float:
    start = time.perf_counter()
    outs = pipe.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error][:1]
    return elapsed


def run(args: argparse.Namespace) -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="servelab-lora-bench-"))
    base = model_path(args.model, root)
    tokenizer = load_tokenizer(base)
    vocab = load_config(base).vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, min(vocab, 30000), (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    most = max(args.adapters)
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(root / f"a{i}", base, rank=args.rank, seed=i)))
                for i in range(most)]
    common = dict(max_num_batched_tokens=args.budget, max_num_seqs=args.requests)
    pipes = {"base": Pipeline.from_pretrained(base, **common),
             "merged": Pipeline(merged_model(base, adapters[0], args.rank), tokenizer, **common)}
    configs: list[tuple[str, int, int]] = [("base", 0, 0), ("merged", 1, 0)]
    for k in args.adapters:
        for slots in sorted({k, max(1, k // 2)}, reverse=True):
            configs.append(("lora", k, slots))
        configs.append(("sequential", k, 1))
    lora_pipes: dict[int, Pipeline] = {}

    def pipe_for(kind: str, slots: int) -> Pipeline:
        if kind in pipes:
            return pipes[kind]
        if slots not in lora_pipes:
            lora_pipes[slots] = Pipeline.from_pretrained(base, enable_lora=True, max_loras=slots,
                                                         max_lora_rank=args.rank, max_cpu_loras=most, **common)
        return lora_pipes[slots]

    def one(kind: str, k: int, slots: int) -> float:
        pipe = pipe_for(kind, slots)
        if kind in ("base", "merged"):
            return timed(pipe, prompts, params)
        if kind == "lora":
            return timed(pipe, prompts, params, [adapters[i % k] for i in range(len(prompts))])
        return sum(timed(pipe, prompts[j::k], params, adapters[j]) for j in range(k) if prompts[j::k])

    for config in configs:  # warm-up: weights packed, kernels built, adapters loaded
        one(*config)
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    loads: dict[tuple, list[float]] = {c: [] for c in configs}
    for _ in range(args.rounds):
        for config in configs:
            loads[config].append(os.getloadavg()[0])
            times[config].append(one(*config))
    return rows_of(args, configs, times, loads, lora_pipes)


def rows_of(args, configs, times, loads, lora_pipes) -> list[dict]:
    tokens = args.requests * args.max_tokens
    rows = []
    shared = dict(model=args.model, requests=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                  rank=args.rank, threads=torch.get_num_threads(), budget=args.budget)
    base_times = times[("base", 0, 0)]
    for kind, k, slots in configs:
        p = dict(shared, distinct_adapters=k, max_loras=slots)
        tps = [tokens / t for t in times[(kind, k, slots)]]
        q = percentiles(tps)
        rows.append(make_row("lora", kind, "tokens_per_s", "tok/s", statistics.median(tps), params=p,
                             p20=q["p20"], p80=q["p80"]))
        rows.append(make_row("lora", kind, "load_1m", "load", statistics.median(loads[(kind, k, slots)]), params=p))
        if kind in ("lora", "merged", "sequential"):
            ratio = [b / t for b, t in zip(base_times, times[(kind, k, slots)])]
            rows.append(make_row("lora", kind, "ratio_vs_base", "x", statistics.median(ratio), params=p))
        if kind == "lora":
            seq = times[("sequential", k, 1)]
            ratio = [s / t for s, t in zip(seq, times[(kind, k, slots)])]
            rows.append(make_row("lora", kind, "ratio_vs_sequential", "x", statistics.median(ratio), params=p))
    for slots, pipe in lora_pipes.items():
        stats = pipe.lora_manager.stats
        p = dict(shared, max_loras=slots)
        if stats.loads:
            rows.append(make_row("lora", "manager", "load_ms", "ms", 1e3 * stats.load_seconds / stats.loads, params=p))
        if stats.activations:
            rows.append(make_row("lora", "manager", "activate_ms", "ms",
                                 1e3 * stats.activate_seconds / stats.activations, params=p))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, smollm2, or a checkpoint folder")
    parser.add_argument("--adapters", type=comma_separated(int), default=[1, 2, 4, 8, 16],
                        help="distinct adapter counts")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-write", action="store_true", help="print the rows, append nothing")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    for r in rows:
        print(f"{r['implementation']:>10} {r['metric']:>20} {r['value']:>10.3f} {r['params']}")
    if not args.no_write:
        print("appended to", append_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
