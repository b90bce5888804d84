"""KV connectors on the real CPU pipeline: what a host tier buys, and what a P/D handoff costs.

    python bench/connectors.py                    # SmolLM2-135M (cached), 1 thread, ~3 min on a quiet core
    python bench/connectors.py --model tiny --no-record   # smoke run on the random tiny Llama

**Offload** (question: hit rate and TTFT with a host tier when the pool is too
small for the workload's shared prefixes). A conversation workload shaped like
the Mooncake conversation trace's prefix structure, scaled to the model's
context: ``--conversations`` chats, each a system prompt shared by all chats
plus its own turns; turn ``t`` of a chat re-sends the whole history (previous
turns and answers) plus a new user message, and chats advance round robin, so
by the time a chat comes back its history has been evicted from a pool of
``--num-blocks``. Requests run one at a time (TTFT is then prefill time, not
queueing). Runs with and without ``OffloadConnector`` are interleaved and
repeated (``--repeats``); reported: the prefix hit rate (prompt tokens not
computed / prompt tokens) and TTFT p50/p90 per run, then p20/p50/p80 across
runs. Greedy outputs are checked equal across the two.

**P/D handoff** (question: is shipping a prompt's KV cheaper than recomputing
it?): a prefill pipeline with a producer ``PDConnector`` and a decode pipeline
with a consumer, one process (``InProcessChannel``: the consumer copies the
producer's blocks). For prompts of ``--pd-lengths`` tokens: bytes moved, the
pull's seconds, and the decode side's TTFT with the handoff vs the same
request recomputed from scratch on the decode pipeline.

Rows go to ``bench/results/results.csv`` (component ``kv_connectors``); the
machine is shared when it is (say so when quoting): interleaving A/B keeps the
comparison fair, absolute times are noisy.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import append_rows, make_row, percentiles  # noqa: E402


def load(model_name: str, folder: str):
    from servelab.models import build_tiny_model, hub, load_model, load_tokenizer

    path = hub.fetch_smollm2() if model_name == "smollm2" else build_tiny_model(Path(folder) / "tiny", arch="llama")
    model, _ = load_model(path)
    return model, load_tokenizer(path)


def conversations(args, vocab: int) -> list[list[int]]:
    """Prompts in arrival order: round robin over chats, each turn re-sending its history."""
    rng = random.Random(args.seed)
    system = [1] + [rng.randrange(100, vocab) for _ in range(args.system_tokens - 1)]
    history = [system + [rng.randrange(100, vocab) for _ in range(args.turn_tokens)] for _ in range(args.conversations)]
    prompts = []
    for _ in range(args.turns):
        for c in range(args.conversations):
            prompts.append(list(history[c]))
            # the answer (stand-in tokens) and the next user message extend the history
            history[c] += [rng.randrange(100, vocab) for _ in range(args.max_tokens + args.turn_tokens)]
    return prompts


def run_offload(pipe, prompts, max_tokens: int) -> dict:
    from servelab import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ttfts, cached, total, outs = [], 0, 0, []
    with torch.inference_mode():
        for prompt in prompts:
            out = pipe.generate([prompt], params)[0]
            ttfts.append(out.metrics.ttft)
            cached += out.metrics.num_cached_tokens
            total += len(prompt)
            outs.append(tuple(out.token_ids))
    q = statistics.quantiles(ttfts, n=10)
    return dict(hit_rate=cached / total, ttft_p50=statistics.median(ttfts), ttft_p90=q[8], outs=outs)


def offload_rows(args, model, tok) -> list[dict]:
    from servelab import Pipeline
    from servelab.connectors.offload import OffloadConnector

    prompts = conversations(args, model.config.vocab_size)
    kw = dict(block_size=args.block_size, num_blocks=args.num_blocks, enable_prefix_caching=True,
              max_model_len=max(len(p) for p in prompts) + args.max_tokens + args.block_size)
    runs: dict[str, list[dict]] = {"none": [], "offload": []}
    for rep in range(args.repeats):
        for name in ("none", "offload") if rep % 2 == 0 else ("offload", "none"):
            conn = OffloadConnector(cpu_blocks=args.cpu_blocks) if name == "offload" else None
            pipe = Pipeline(model, tok, kv_connector=conn, **kw)
            result = run_offload(pipe, prompts, args.max_tokens)
            if conn is not None:
                result["tier"] = conn.stats()
                conn.shutdown()
            runs[name].append(result)
            print(f"  {name:8s} rep {rep}: hit rate {result['hit_rate']:.3f}  TTFT p50 {result['ttft_p50'] * 1e3:7.1f} ms"
                  f"  p90 {result['ttft_p90'] * 1e3:7.1f} ms" + (f"  tier {result['tier']}" if conn else ""))
    assert runs["none"][0]["outs"] == runs["offload"][0]["outs"], "offload changed greedy outputs"
    params = dict(model=args.model, threads=args.threads, block_size=args.block_size, num_blocks=args.num_blocks,
                  cpu_blocks=args.cpu_blocks, conversations=args.conversations, turns=args.turns,
                  system_tokens=args.system_tokens, turn_tokens=args.turn_tokens, max_tokens=args.max_tokens,
                  repeats=args.repeats, workload="round-robin conversations (Mooncake-like prefix structure)")
    rows = []
    for name, results in runs.items():
        for metric, unit, scale in (("prefix_hit_rate", "fraction", 1.0), ("ttft_p50", "ms", 1e3),
                                    ("ttft_p90", "ms", 1e3)):
            key = metric if metric != "prefix_hit_rate" else "hit_rate"
            samples = [r[key] * scale for r in results]
            p = percentiles(samples)
            rows.append(make_row("kv_connectors", f"offload:{name}", metric, unit, p["p50"],
                                 params=params, **p))
    return rows


class TimedChannel:
    """An ``InProcessChannel`` that times its pulls."""

    def __new__(cls):
        from servelab.connectors.channels import InProcessChannel

        class Timed(InProcessChannel):
            def __init__(self):
                super().__init__()
                self.pull_seconds: list[float] = []

            def pull(self, transfer_id, indices, writer):
                start = time.perf_counter()
                ok = super().pull(transfer_id, indices, writer)
                self.pull_seconds.append(time.perf_counter() - start)
                return ok

        return Timed()


def pd_rows(args, model, tok) -> list[dict]:
    from servelab import Pipeline, SamplingParams
    from servelab.connectors.pd import PDConnector

    rng = random.Random(args.seed + 1)
    rows = []
    vocab = model.config.vocab_size
    for length in args.pd_lengths:
        kw = dict(block_size=args.block_size, num_blocks=4 * (length // args.block_size + 2), enable_prefix_caching=True,
                  max_model_len=length + args.max_tokens + args.block_size)
        handoff, recompute, nbytes, pulls = [], [], [], []
        for rep in range(args.repeats):
            channel = TimedChannel()
            prefill = Pipeline(model, tok, kv_connector=PDConnector("producer", channel), **kw)
            decode = Pipeline(model, tok, kv_connector=PDConnector("consumer", channel), **kw)
            plain = Pipeline(model, tok, **kw)
            prompt = [1] + [rng.randrange(100, vocab) for _ in range(length - 1)]
            with torch.inference_mode():
                for pipe in (decode, plain):  # warm both (first-forward costs are not the handoff's)
                    pipe.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
                first = prefill.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0]
                params = prefill.kv_connector.transfer_params(first.request_id)
                state = params["token_ids"]
                tail = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                      extra_args={"kv_transfer_params": params})
                before = channel.bytes_pulled
                with_kv = decode.generate([state], tail)[0]
                without = plain.generate([state], SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                                 ignore_eos=True))[0]
            assert with_kv.token_ids == without.token_ids, "the handoff changed greedy outputs"
            handoff.append(with_kv.metrics.ttft)
            recompute.append(without.metrics.ttft)
            nbytes.append(channel.bytes_pulled - before)
            pulls.append(channel.pull_seconds[-1])
            prefill.step()
        print(f"  pd {length:5d} tokens: {statistics.median(nbytes) / 2**20:6.2f} MiB, pull "
              f"{statistics.median(pulls) * 1e3:6.2f} ms; decode TTFT with handoff "
              f"{statistics.median(handoff) * 1e3:7.1f} ms vs recompute {statistics.median(recompute) * 1e3:7.1f} ms")
        params = dict(model=args.model, threads=args.threads, block_size=args.block_size, prompt_tokens=length,
                      repeats=args.repeats, channel="in-process")
        for impl, metric, unit, samples in (("pd:handoff", "bytes_moved", "MiB", [b / 2**20 for b in nbytes]),
                                            ("pd:handoff", "pull_time", "ms", [s * 1e3 for s in pulls]),
                                            ("pd:handoff", "decode_ttft", "ms", [s * 1e3 for s in handoff]),
                                            ("pd:recompute", "decode_ttft", "ms", [s * 1e3 for s in recompute])):
            p = percentiles(samples)
            rows.append(make_row("kv_connectors", impl, metric, unit, p["p50"], params=params, **p))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=40, help="KV pool (too small for every chat's history)")
    parser.add_argument("--cpu-blocks", type=int, default=512, help="host tier capacity (blocks)")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=96)
    parser.add_argument("--turn-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pd-lengths", type=int, nargs="*", default=[128, 512])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", nargs="+", choices=["offload", "pd"], default=["offload", "pd"])
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    for name in ("threads", "block_size", "num_blocks", "cpu_blocks", "conversations", "turns", "system_tokens",
                 "turn_tokens", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        model, tok = load(args.model, folder)
        rows = []
        if "offload" in args.parts:
            print("offload: conversations through a small pool, with and without a host tier")
            rows += offload_rows(args, model, tok)
        if "pd" in args.parts:
            print("pd: handoff vs recompute")
            rows += pd_rows(args, model, tok)
    if not args.no_record:
        print(f"results: {append_rows(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
