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

Each configuration's pipeline is built in turn (one at a time beside the base model's: a
small machine holds no more), warmed, then measured ``--rounds`` times, each round running
the base model, the configuration and (LoRA) the one-after-another serving back to back;
rows hold the median over rounds (p20/p80 the spread) of output tokens per second, and the
ratios taken within a round: ``lora`` over ``base`` and ``lora`` over ``sequential`` (the
issue's targets: >= 0.7 and >= 4 at 8 adapters). ``load_ms`` / ``activate_ms``: reading an adapter folder, and writing it
into a slot of every wrapped layer. Every timed configuration also records ``load_1m``
(``os.getloadavg()``): the machine may be shared.

Adapters are written in PEFT's format directly (random A, B; rank ``--rank``; q/k/v/o and
gate/up/down), which is what ``peft``'s ``save_pretrained`` writes.

Usage: ``python bench/lora.py [--model smollm2] [--adapters 1,2,4,8,16] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import gc
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


def groups_of(adapter_counts: list[int], below: bool) -> list[tuple[str, int, int]]:
    """``(kind, distinct adapters, max_loras)`` of each pipeline built in turn (memory: one at a time)."""
    groups = [("merged", 1, 0)]
    for k in adapter_counts:
        groups.append(("lora", k, k))
        if below and k > 1:
            groups.append(("lora", k, k // 2))
    return groups


def run(args: argparse.Namespace) -> list[dict]:
    """Each group's pipeline is built, warmed, measured ``--rounds`` times interleaved with the base
    model (and, for LoRA, serving the adapters one after another), then dropped: one SmolLM2
    pipeline per configuration at once would not fit a small machine."""
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
    common = dict(max_num_batched_tokens=args.budget, max_num_seqs=args.requests, num_blocks=args.num_blocks)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    base_pipe = Pipeline.from_pretrained(base, **common)
    base_pipe.generate(prompts[:2], warm)
    rows: list[dict] = []
    for kind, k, slots in groups_of(args.adapters, args.below):
        if kind == "merged":
            pipe = Pipeline(merged_model(base, adapters[0], args.rank), tokenizer, **common)
        else:
            pipe = Pipeline.from_pretrained(base, enable_lora=True, max_loras=slots, max_lora_rank=args.rank,
                                            max_cpu_loras=most, **common)
        loras = [adapters[i % k] for i in range(len(prompts))] if kind == "lora" else None
        pipe.generate(prompts[:2], warm, lora_request=loras[:2] if loras else None)
        times: dict[str, list[float]] = {"base": [], kind: [], "sequential": []}
        loads: list[float] = []
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            times["base"].append(timed(base_pipe, prompts, params))
            times[kind].append(timed(pipe, prompts, params, loras))
            if kind == "lora":  # the same adapters served one after another (one generate each)
                times["sequential"].append(sum(timed(pipe, prompts[j::k], params, adapters[j])
                                               for j in range(k) if prompts[j::k]))
        rows += rows_of(args, kind, k, slots, times, loads, getattr(pipe, "lora_manager", None))
        del pipe
        gc.collect()
    return rows


def rows_of(args, kind: str, k: int, slots: int, times: dict, loads: list[float], manager) -> list[dict]:
    tokens = args.requests * args.max_tokens
    p = dict(model=args.model, requests=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
             rank=args.rank, threads=torch.get_num_threads(), budget=args.budget, distinct_adapters=k,
             max_loras=slots)
    rows = []

    def throughput(implementation: str, seconds: list[float]) -> None:
        tps = [tokens / t for t in seconds]
        q = percentiles(tps)
        rows.append(make_row("lora", implementation, "tokens_per_s", "tok/s", statistics.median(tps), params=p,
                             p20=q["p20"], p80=q["p80"]))

    def ratio(implementation: str, metric: str, over: list[float], under: list[float]) -> None:
        values = [a / b for a, b in zip(over, under)]  # each from one round: the same load
        q = percentiles(values)
        rows.append(make_row("lora", implementation, metric, "x", statistics.median(values), params=p,
                             p20=q["p20"], p80=q["p80"]))

    throughput(kind, times[kind])
    throughput(f"base (beside {kind})", times["base"])
    ratio(kind, "ratio_vs_base", times["base"], times[kind])
    rows.append(make_row("lora", kind, "load_1m", "load", statistics.median(loads), params=p))
    if kind == "lora":
        throughput("sequential", times["sequential"])
        ratio(kind, "ratio_vs_sequential", times["sequential"], times[kind])
        stats = manager.stats
        if stats.loads:
            rows.append(make_row("lora", "manager", "load_ms", "ms", 1e3 * stats.load_seconds / stats.loads, params=p))
        if stats.activations:
            rows.append(make_row("lora", "manager", "activate_ms", "ms",
                                 1e3 * stats.activate_seconds / stats.activations, params=p))
            rows.append(make_row("lora", "manager", "activations", "count", stats.activations, params=p))
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
    parser.add_argument("--num-blocks", type=int, default=512, help="KV pool (small: the machine may be shared)")
    parser.add_argument("--below", action=argparse.BooleanOptionalAction, default=True,
                        help="also max_loras = adapters // 2")
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
