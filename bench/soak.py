"""Soak: many requests through one pipeline while faults keep firing; memory must stay flat.

    python bench/soak.py                         # 10,000 requests (a few minutes on 2 cores)
    python bench/soak.py --num-requests 500 --window 100 --no-record   # smoke run

One ``Pipeline`` on a random tiny Llama (prefix caching on, a KV pool small
enough that requests get preempted) serves ``--num-requests`` requests in
``generate`` calls of ``--batch-size`` (prompts share a few prefixes; greedy
and sampled; 4-16 output tokens). About every ``--fault-every`` requests one
fault is injected, rotating through: the model forward raising an exception,
the forward interrupted (``KeyboardInterrupt``), a logits processor raising
for one request, a scheduling-policy hook raising for one request, and the
tokenizer failing while detokenizing one call.

Recorded every ``--window`` requests (default 1,000, and at the end): resident memory (RSS, after
``gc.collect()``), free KV blocks while idle, throughput (requests/s and
output tokens/s over the window). Checked, and the exit status is 1 when one
fails:

- RSS growth after warm-up (the first window) < 5%;
- zero leaked KV blocks whenever the pipeline is idle;
- a greedy probe request (a prompt sharing the workload's prefixes) gives a
  fresh pipeline's output after every fault (no poisoned prefix cache);
- no collateral failure: a fault aimed at one request (the logits processor,
  the policy hook) fails that request only, the tokenizer fault at most the
  one request being delivered; only a forward fault may fail its whole batch.

Rows go to ``bench/results/results.csv`` (component ``soak``): RSS per
checkpoint, window throughput (value = median window, p20/p80 across
windows), RSS growth, leaked blocks, probe mismatches, requests failed,
collateral failures and faults injected. ``params`` name the decode path
(``c_decode_kernel``: whether the compiled CPU decode kernel was used).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import append_rows, make_row  # noqa: E402

FAULTS = ("forward_error", "forward_interrupt", "processor", "policy_hook", "detokenizer")


def rss_bytes() -> int:
    """Current resident set size (Linux ``/proc``; elsewhere the peak from ``getrusage``)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Injector:
    """The faults of the soak, each reached through public seams of the pipeline."""

    def __init__(self) -> None:
        self.armed: str | None = None
        self.count = 0
        self.scope: set[str] = set()  # the requests of the step a forward fault failed

    def fire(self, name: str) -> BaseException:
        self.armed = None
        self.count += 1
        if name == "forward_interrupt":
            return KeyboardInterrupt("soak: injected interrupt")
        return RuntimeError(f"soak: injected fault ({name})")

    def tagged(self, params) -> bool:
        extra = getattr(params, "extra_args", None) or {}
        return bool(extra.get("victim"))


def build_pipeline(folder: str, injector: Injector, args):
    """Pipeline over a tiny model with a raising-on-demand processor, policy and tokenizer."""
    from servelab import Pipeline
    from servelab.models import build_tiny_model, load_model, load_tokenizer
    from servelab.samplers import Sampler
    from servelab.scheduling.interfaces import SchedulingPolicy

    class Processor:
        argmax_invariant = False

        def apply(self, logits, metadata):
            if injector.armed == "processor" and any(injector.tagged(p) for p in metadata.params):
                raise injector.fire("processor")
            return logits

    class Policy(SchedulingPolicy):
        name = "soak-fcfs"

        def key(self, request):
            return request.arrival_time

        def on_tokens_scheduled(self, request, num_new_tokens):
            if injector.armed == "policy_hook" and injector.tagged(request.sampling_params):
                raise injector.fire("policy_hook")

    class Tokenizer:
        def __init__(self, inner) -> None:
            self._inner = inner

        def decode(self, *a, **k):
            if injector.armed == "detokenizer":
                raise injector.fire("detokenizer")
            return self._inner.decode(*a, **k)

        def __getattr__(self, name):
            return getattr(self._inner, name)

    path = build_tiny_model(Path(folder) / "tiny", arch="llama", seed=0)
    model, _ = load_model(path)
    tokenizer = load_tokenizer(path)
    pipe = Pipeline(model, Tokenizer(tokenizer), block_size=8, num_blocks=args.num_blocks, max_model_len=128,
                    max_num_seqs=16, max_num_batched_tokens=256, enable_prefix_caching=True, policy=Policy(),
                    sampler=Sampler(logits_processors=[Processor()]), attention_backend=args.backend)
    reference = Pipeline(model, tokenizer, block_size=8, num_blocks=64, max_model_len=128,
                         enable_prefix_caching=False, attention_backend=args.backend)
    real_forward = model.forward

    def forward(*a, **k):
        if injector.armed in ("forward_error", "forward_interrupt"):
            injector.scope = set(pipe.scheduler.in_flight_output.num_scheduled_tokens)
            raise injector.fire(injector.armed)
        return real_forward(*a, **k)

    model.forward = forward
    return pipe, reference


def make_batch(rng: random.Random, prefixes, size: int, victim: bool):
    from servelab.samplers import SamplingParams

    prompts, params = [], []
    for i in range(size):
        prompts.append(rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 24))])
        extra = {"victim": victim and i == size // 2}
        max_tokens = rng.randrange(4, 17)
        if rng.random() < 0.5:
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra))
        else:
            params.append(SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, extra_args=extra))
    return prompts, params


def run(args) -> tuple[list[dict], bool]:
    from servelab.samplers import SamplingParams

    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    prefixes = [[1] + [rng.randrange(3, 500) for _ in range(31)] for _ in range(4)]
    injector = Injector()
    with tempfile.TemporaryDirectory() as folder:
        pipe, reference = build_pipeline(folder, injector, args)
        probe = prefixes[0] + [7, 8, 9]
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        want = reference.generate([probe], greedy)[0].token_ids
        windows, checkpoints = [], []
        done = failed = tokens = leaks = mismatches = collateral = 0
        window_start, window_tokens, window_done = time.perf_counter(), 0, 0
        next_fault = args.fault_every
        while done < args.num_requests:
            size = min(args.batch_size, args.num_requests - done)
            fault = done + size >= next_fault
            if fault:
                name = injector.armed = FAULTS[(next_fault // args.fault_every) % len(FAULTS)]
                next_fault += args.fault_every
            prompts, params = make_batch(rng, prefixes, size, victim=fault)
            try:
                outs = pipe.generate(prompts, params)
            except (KeyboardInterrupt, RuntimeError) as exc:
                if "soak: injected" not in str(exc):
                    raise
                outs = pipe.last_outputs
            fired, injector.armed = injector.armed is None, None
            failed += sum(o.finish_reason in ("error", "abort") for o in outs) + (size - len(outs))
            collateral += count_collateral(name if fault else None, fired, injector.scope, outs, params)
            injector.scope = set()
            n_tok = sum(len(o.token_ids) for o in outs)
            tokens, window_tokens = tokens + n_tok, window_tokens + n_tok
            done, window_done = done + size, window_done + size
            free = pipe.kv_cache_manager.num_free_blocks
            if free != pipe.num_blocks - 1 or pipe.has_unfinished_requests():
                leaks += 1
                print(f"  leak after request {done}: {pipe.num_blocks - 1 - free} blocks held", file=sys.stderr)
            if fault and pipe.generate([probe], greedy)[0].token_ids != want:
                mismatches += 1
                print(f"  poisoned cache after request {done}", file=sys.stderr)
            if window_done >= args.window or done >= args.num_requests:
                elapsed = time.perf_counter() - window_start
                gc.collect()
                windows.append({"requests": window_done, "seconds": elapsed, "tokens": window_tokens})
                checkpoints.append({"requests": done, "rss": rss_bytes(), "free_blocks": free})
                print(f"{done:>7} requests  rss {checkpoints[-1]['rss'] / 2**20:8.1f} MiB  free blocks {free:>4}"
                      f"  {window_done / elapsed:7.1f} req/s  {window_tokens / elapsed:8.1f} tok/s"
                      f"  faults {injector.count}  failed {failed}")
                window_start, window_tokens, window_done = time.perf_counter(), 0, 0
    base = checkpoints[0]["rss"]  # after the warm-up window
    growth = (checkpoints[-1]["rss"] - base) / base * 100
    ok = growth < 5.0 and leaks == 0 and mismatches == 0 and collateral == 0
    print(f"RSS growth after warm-up {growth:+.2f}% (limit 5%), leaks {leaks}, poisoned probes {mismatches}, "
          f"collateral failures {collateral}, faults {injector.count}, failed requests {failed}: "
          f"{'OK' if ok else 'FAILED'}")
    counts = dict(leaks=leaks, mismatches=mismatches, failed=failed, collateral=collateral, faults=injector.count)
    return summary_rows(args, windows, checkpoints, growth, counts), ok


def count_collateral(name: str | None, fired: bool, scope: set[str], outs, params) -> int:
    """Failed requests the batch's fault had no business failing (see the module docstring).

    ``name``: the fault armed for this batch (None: none); ``fired``: whether
    it fired; ``scope``: for a forward fault, the requests of the failed step."""
    errors = [(o, p) for o, p in zip(outs, params) if o.finish_reason == "error"]
    if name is None or not fired or name == "forward_interrupt":  # nothing may fail with "error"
        return len(errors)
    if name == "forward_error":
        return sum(o.request_id not in scope for o, _ in errors)
    if name == "detokenizer":  # the one request being delivered
        return max(len(errors) - 1, 0)
    return sum(not (p.extra_args or {}).get("victim") for _, p in errors)  # aimed at the victim


def summary_rows(args, windows, checkpoints, growth, counts) -> list[dict]:
    from servelab.attention import cpu_decode

    params = {"num_requests": args.num_requests, "window": args.window, "batch_size": args.batch_size, "fault_every": args.fault_every,
              "num_blocks": args.num_blocks, "backend": args.backend, "model": "tiny-llama",
              "threads": args.threads, "decode_path": "carried-kv", "c_decode_kernel": bool(cpu_decode.available())}
    rows = [make_row("soak", "servelab", "rss_mib", "MiB", c["rss"] / 2**20,
                     params={**params, "after_requests": c["requests"]}) for c in checkpoints]
    for metric, unit, key in (("throughput_req_per_s", "req/s", "requests"), ("throughput_tok_per_s", "tok/s", "tokens")):
        rates = sorted(w[key] / w["seconds"] for w in windows)
        q = statistics.quantiles(rates, n=5) if len(rates) > 1 else [rates[0]] * 4
        rows.append(make_row("soak", "servelab", metric, unit, statistics.median(rates), params=params,
                             p20=q[0], p50=statistics.median(rates), p80=q[3]))
    for metric, unit, value in (("rss_growth_after_warmup", "%", growth),
                                ("leaked_block_events", "count", counts["leaks"]),
                                ("poisoned_probes", "count", counts["mismatches"]),
                                ("failed_requests", "count", counts["failed"]),
                                ("collateral_failures", "count", counts["collateral"]),
                                ("faults_injected", "count", counts["faults"])):
        rows.append(make_row("soak", "servelab", metric, unit, value, params=params))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=50, help="requests per generate() call")
    parser.add_argument("--fault-every", type=int, default=100, help="requests between injected faults")
    parser.add_argument("--num-blocks", type=int, default=96, help="KV pool (small: requests get preempted)")
    parser.add_argument("--backend", default="sdpa", help="attention backend (sdpa, torch)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--window", type=int, default=1000, help="requests between RSS / throughput records")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true", help="do not append rows to results.csv")
    args = parser.parse_args(argv)
    for name in ("num_requests", "batch_size", "fault_every", "num_blocks", "threads", "window"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    rows, ok = run(args)
    if not args.no_record:
        print(f"results: {append_rows(rows)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
