"""Where a pipeline step spends its time: schedule, input prep, forward (split), sampling, detok, bookkeeping.

Runs ``Pipeline.generate`` on a fixed greedy workload under ``cProfile`` and
sorts the cumulative times of known functions into the parts of a step:

- **schedule**: ``Scheduler.schedule``;
- **input prep**: ``ModelRunner._update_states`` + ``ModelRunner._prepare``;
- **forward** (``LlamaForCausalLM.forward``), split into GEMMs (every
  ``torch._C._nn.linear`` call and every packed oneDNN GEMM,
  ``torch.ops.mkldnn._linear_pointwise``), attention (``paged_attention``, planning
  included), KV write (``reshape_and_cache``), norms + RoPE (``RMSNorm``, ``apply_rotary``,
  ``RotaryEmbedding``) and the rest (embedding, SiLU, residual adds);
- **logits**: ``compute_logits`` (the LM-head GEMM on the sampled rows);
- **sampling**: ``ModelRunner._sample_plain`` (metadata + sampler);
- **detok**: ``IncrementalDetokenizer`` calls;
- **bookkeeping**: the rest of ``Pipeline.step`` (``update_from_output``,
  outputs, metrics).

cProfile's own overhead inflates Python-heavy parts (schedule, prep,
bookkeeping) relative to the big tensor ops; the un-profiled wall time of the
same run is reported beside it. ``--torch-profiler`` adds the top ATen ops by
self CPU time.

    python bench/profile_step.py --model tiny
    python bench/profile_step.py --model smollm2-shape --num-prompts 16 --max-tokens 16
    python bench/profile_step.py --model PATH --torch-profiler
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

# (category, file suffix, function name); cumulative times are summed per category.
PARTS = [
    ("schedule", "scheduling/scheduler.py", "schedule"),
    ("input prep", "pipeline/runner.py", "_update_states"),
    ("input prep", "pipeline/runner.py", "_prepare"),
    ("forward", "models/llama.py", "forward:LlamaForCausalLM"),
    ("logits", "models/llama.py", "compute_logits"),
    ("sampling", "pipeline/sampling_steps.py", "_sample_plain"),
    ("sampling", "pipeline/sampling_steps.py", "_verify"),
    ("detok", "pipeline/detokenizer.py", "update"),
    ("detok", "pipeline/detokenizer.py", "flush"),
    ("step (total)", "pipeline/pipeline.py", "step"),
]
FORWARD_PARTS = [
    # The model's per-step attention wrapper: every layer, whatever the backend.
    ("attention", "models/llama.py", "paged_attention"),
    ("KV write", "models/llama.py", "reshape_and_cache"),
    ("norms + RoPE", "models/layers.py", "forward:RMSNorm"),
    ("norms + RoPE", "models/layers.py", "apply_rotary"),
    ("norms + RoPE", "models/llama.py", "rotate"),
    ("norms + RoPE", "models/layers.py", "forward:RotaryEmbedding"),
]

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
                     tie_word_embeddings=True, rope_theta=100000.0)


def build(model: str, root: Path) -> Path:
    """A checkpoint folder: ``tiny`` (hidden 256, 4 layers), ``smollm2-shape`` (random
    weights with SmolLM2-135M's shapes), or an existing folder."""
    from servelab.models import build_tiny_model

    if model == "tiny":
        return build_tiny_model(root / "tiny", arch="llama", seed=0, hidden_size=256, intermediate_size=768,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=2048)
    if model == "smollm2-shape":
        return build_tiny_model(root / "smollm2-shape", arch="llama", seed=0, **SMOLLM2_SHAPE)
    return Path(model)


def _line_of(stats: pstats.Stats) -> dict[tuple[str, str], list[tuple]]:
    """(file, func) -> stat tuples, to resolve name clashes (``forward``) by line owner."""
    out: dict[tuple[str, str], list[tuple]] = {}
    for (file, line, func), value in stats.stats.items():
        out.setdefault((file.replace("\\", "/"), func), []).append((line, value))
    return out


def _cumulative(stats: pstats.Stats, suffix: str | None, func: str) -> float:
    """Cumulative seconds of the function(s) matching; ``forward:Class`` picks a class's forward by source."""
    import inspect
    import importlib

    owner = None
    if ":" in func:
        func, owner = func.split(":")
    lines = None
    if owner is not None:
        module = {"LlamaForCausalLM": "servelab.models.llama", "RMSNorm": "servelab.models.layers",
                  "RotaryEmbedding": "servelab.models.layers"}[owner]
        cls = getattr(importlib.import_module(module), owner)
        lines = {inspect.getsourcelines(getattr(cls, func))[1]}
    total = 0.0
    for (file, line, name), (_, _, _, ct, callers) in stats.stats.items():
        if name != func or (suffix is not None and not file.replace("\\", "/").endswith(suffix)):
            continue
        if lines is not None and line not in lines:
            continue
        # Count only outermost calls: skip time spent called from another matching function.
        total += ct - sum(v[3] for (cf, cl, cn), v in callers.items()
                          if cn == func and (suffix is None or cf.replace("\\", "/").endswith(suffix)))
    return total


def _builtin(stats: pstats.Stats, name: str) -> float:
    return sum(v[2] for (file, _, func), v in stats.stats.items() if file == "~" and name in func)


def breakdown(stats: pstats.Stats) -> list[tuple[str, float]]:
    parts: dict[str, float] = {}
    for category, suffix, func in PARTS:
        parts[category] = parts.get(category, 0.0) + _cumulative(stats, suffix, func)
    forward = parts["forward"]
    # Every F.linear call and every packed oneDNN GEMM (servelab.models.linear) is a GEMM;
    # the LM head's belong to "logits".
    gemms = _builtin(stats, "torch._C._nn.linear") + _builtin(stats, "mkldnn._linear_pointwise")
    sub: dict[str, float] = {"GEMMs": gemms - parts["logits"]}
    for category, suffix, func in FORWARD_PARTS:
        sub[category] = sub.get(category, 0.0) + _cumulative(stats, suffix, func)
    sub["other forward (embedding, SiLU, adds)"] = forward - sum(sub.values())
    step = parts.pop("step (total)")
    named = sum(parts.values())
    rows = [(k, v) for k, v in parts.items()]
    rows[rows.index(("forward", forward)) + 1:rows.index(("forward", forward)) + 1] = [
        (f"  forward: {k}", v) for k, v in sub.items()]
    rows.append(("bookkeeping (rest of step)", step - named))
    rows.append(("step (total)", step))
    return rows


def workload(num_prompts: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num_prompts)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny, smollm2-shape, or a checkpoint folder")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", default="36,264")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--torch-profiler", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from servelab import Pipeline
    from servelab.models import load_model, load_tokenizer
    from servelab.samplers import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = build(args.model, Path(tmp))
        model, config = load_model(path)
        try:
            tokenizer = load_tokenizer(path)
        except Exception:  # noqa: BLE001 - a bare weights folder: token ids only
            tokenizer = None
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    prompts = workload(args.num_prompts, lo, hi, min(config.vocab_size, 500))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    pipe = Pipeline(model, tokenizer, attention_backend=args.backend, max_num_seqs=args.num_prompts,
                    max_num_batched_tokens=4096, max_model_len=1024)
    pipe.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    pipe.generate(prompts, params)
    wall = time.perf_counter() - start
    profiler = cProfile.Profile()
    profiler.enable()
    pipe.generate(prompts, params)
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = breakdown(stats)
    total = rows[-1][1]
    n_tok = args.num_prompts * args.max_tokens
    print(f"model {args.model}, backend {args.backend}, {args.threads} thread(s), {args.num_prompts} prompts "
          f"{lo}-{hi} tokens x {args.max_tokens} new; wall {wall:.2f} s ({n_tok / wall:.1f} tok/s) unprofiled\n")
    print("| part | seconds (cProfile) | share of step |\n|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {100 * seconds / total:.1f}% |")
    if args.torch_profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pipe.generate(prompts, params)
        print()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
