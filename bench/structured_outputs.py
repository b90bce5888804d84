"""Structured outputs: what a grammar costs per step, and end to end.

1. Bitmask fill + apply time per step vs batch size and vocabulary size
   (32k and 152k, synthetic byte-level-like vocabularies so no download is
   needed): every request of the batch holds a JSON-schema matcher a few
   tokens into its output; "fill" is the matchers writing their rows,
   "apply" is :func:`servelab.samplers.structured.apply_token_bitmask` on
   float32 ``[batch, vocab]`` logits (the CPU path; ``--backend triton`` on a GPU).
2. ``--e2e``: tokens/s of a Pipeline on the tiny model with and without a
   JSON-schema constraint (same prompts, greedy).

Rows go to ``bench/results/results.csv`` (component ``structured``).

    python bench/structured_outputs.py [--batch 1,16,64] [--vocab 32000,152064] [--e2e]
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import append_rows, make_row, percentiles  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def synthetic_vocab(size: int, seed: int = 0) -> list[str]:
    """Every printable character, then random 2–8 character pieces (unique)."""
    rng = random.Random(seed)
    vocab = list(dict.fromkeys(string.printable))
    seen = set(vocab)
    alphabet = string.ascii_letters + string.digits + ' {}":,[]'
    while len(vocab) < size:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    return vocab


def time_bitmask(vocab_size: int, batch: int, repeats: int, backend: str) -> tuple[list[float], list[float]]:
    import xgrammar as xgr

    from servelab.samplers.structured import apply_token_bitmask

    info = xgr.TokenizerInfo(synthetic_vocab(vocab_size), vocab_size=vocab_size, stop_token_ids=[0])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA),
                                                                            any_whitespace=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    for m in matchers:  # a few tokens into the object: '{"name":"'
        m.accept_string('{"name":"')
    bitmask = torch.full((batch, -(-vocab_size // 32)), -1, dtype=torch.int32)
    device = "cuda" if backend == "triton" else "cpu"
    logits = torch.randn(batch, vocab_size, device=device)
    fill, apply = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, row)
        fill.append(time.perf_counter() - start)
        mask = bitmask.to(device)
        start = time.perf_counter()
        apply_token_bitmask(logits, mask, backend=backend)
        if device == "cuda":
            torch.cuda.synchronize()
        apply.append(time.perf_counter() - start)
    return fill, apply


def e2e(num_prompts: int, max_tokens: int) -> dict[str, float]:
    import tempfile

    from servelab import Pipeline, SamplingParams
    from servelab.models import build_tiny_model
    from servelab.samplers.structured import StructuredOutputsParams

    path = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="llama")
    pipe = Pipeline.from_pretrained(path)
    prompts = [f"Record {i}: the person is" for i in range(num_prompts)]
    out = {}
    for name, extra in (("unconstrained", {}),
                        ("json_schema", {"structured_outputs": StructuredOutputsParams(json=SCHEMA)})):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **extra)
        pipe.generate(prompts[:2], params)  # warm-up (grammar compile, first step)
        start = time.perf_counter()
        outs = pipe.generate(prompts, params)
        out[name] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--vocab", default="32000,152064")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--backend", default="torch", choices=["torch", "triton"])
    parser.add_argument("--e2e", action="store_true", help="also time the pipeline with/without a JSON schema")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            fill, apply = time_bitmask(vocab, batch, args.repeats, args.backend)
            for metric, samples in (("bitmask_fill", fill), ("bitmask_apply", apply)):
                stats = percentiles([s * 1e6 for s in samples])
                rows.append(make_row("structured", f"xgrammar+{args.backend}", metric, "us", stats["p50"],
                                     params={"batch": batch, "vocab": vocab, "threads": 1}, **stats))
                print(f"vocab {vocab:>6} batch {batch:>3} {metric:<13} p50 {stats['p50']:9.1f} us")
    if args.e2e:
        for name, tok_s in e2e(16, 48).items():
            rows.append(make_row("structured", name, "throughput", "tok/s", tok_s,
                                 params={"model": "tiny-llama", "prompts": 16, "max_tokens": 48, "threads": 1}))
            print(f"e2e {name:<14} {tok_s:8.1f} tok/s")
    append_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
