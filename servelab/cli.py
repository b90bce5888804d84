"""``servelab`` console script."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EPILOG = """\
examples:
  servelab demo                          the pipeline on the embedded tiny Llama
  servelab demo --model PATH             any local HF Llama / Qwen2 / Mistral folder
  servelab simulate --policy fcfs,sjf    scheduling policies on a simulated trace
  servelab blocks                        the KV block layer alone under load
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _demo(args: argparse.Namespace) -> int:
    import torch

    from servelab.demo import default_demo_model, run_pipeline_demo

    out = Path(args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else default_demo_model(out)
    if not (model / "config.json").is_file():
        print(f"error: --model {model} is not a Hugging Face checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    print(f"servelab demo: {args.num_requests} chat requests over 3 shared system prompts on {model}, "
          f"{args.attention_backend} attention, n-gram speculation with {args.num_speculative_tokens} drafts\n")
    try:
        metrics, figure, outputs = run_pipeline_demo(
            model, out, num_requests=args.num_requests, max_tokens=args.max_tokens,
            num_speculative_tokens=args.num_speculative_tokens, attention_backend=args.attention_backend,
            num_blocks=args.num_blocks, seed=args.seed)
    except ValueError as exc:  # a model or backend the pipeline refuses, with its reason
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(metrics.table())
    print(f"\nfirst output: {outputs[0].text!r} ({outputs[0].finish_reason})")
    print(f"report figure: {figure}")
    return 1 if metrics.num_errors else 0


def _blocks(args: argparse.Namespace) -> int:
    from servelab.demo import plot_block_demo, run_block_demo

    print(f"servelab blocks: {args.num_requests} requests sharing 4 system prompts, "
          f"{args.num_blocks} KV blocks of {args.block_size} tokens, {args.token_budget} tokens per step\n")
    result = run_block_demo(args.num_requests, args.num_blocks, args.block_size, args.token_budget, args.seed)
    print(result.table())
    figure = plot_block_demo(result, Path(args.out) / "block_demo.png")
    print(f"\nfigure: {figure}")
    if result.leaked_blocks:
        print(f"error: {result.leaked_blocks} blocks leaked", file=sys.stderr)
        return 1
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from servelab.scheduling import SchedulerConfig
    from servelab.scheduling.simulator import (
        LengthDist,
        StepCostModel,
        WorkloadSpec,
        compare_policies,
        format_client_table,
        format_table,
        load_trace_csv,
        plot_results,
        write_csv,
    )

    try:
        policies = [p for p in args.policy.split(",") if p]
        base, per_token, per_kv = (float(x) for x in args.cost_model.split(","))
        cost = StepCostModel(base, per_token, per_kv)
        config = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                                 max_model_len=args.max_model_len,
                                 long_prefill_token_threshold=args.long_prefill_token_threshold)
        if args.trace:
            workload = load_trace_csv(args.trace, rate=args.rate, seed=args.seed)[: args.num_requests]
            what = f"trace {args.trace} ({len(workload)} requests)"
        else:
            weights = tuple(1.0 / (k + 1) ** args.client_skew for k in range(args.num_clients))
            workload = WorkloadSpec(
                num_requests=args.num_requests, rate=args.rate, arrival=args.arrival, burstiness=args.burstiness,
                prompt_len=LengthDist.parse(args.prompt_len), output_len=LengthDist.parse(args.output_len),
                num_prefix_groups=args.num_prefix_groups, prefix_len=args.prefix_len,
                num_clients=args.num_clients, client_weights=weights, num_priorities=args.num_priorities,
                seed=args.seed)
            what = (f"{args.num_requests} requests, {args.arrival} arrivals at {args.rate}/s, prompts "
                    f"{args.prompt_len}, outputs {args.output_len}")
        print(f"servelab simulate: {what}; {args.num_blocks} KV blocks of {args.block_size} tokens\n")
        results = compare_policies(workload, policies, scheduler_config=config, num_blocks=args.num_blocks,
                                   block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                                   cost_model=cost, ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(results))
    if args.num_clients > 1 or args.trace:
        print()
        print(format_client_table(results))
    out = Path(args.out)
    table = write_csv(results, out / "simulate.csv")
    figure = plot_results(results, out / "simulate.png", title=what)
    print(f"\ntable: {table}\nfigure: {figure}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="servelab",
        description="servelab: a kernel-first research toolkit for LLM serving.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="serve a workload through the full pipeline and report metrics")
    demo.add_argument("--model", help="local HF checkpoint folder (default: the embedded tiny Llama)")
    demo.add_argument("--num-requests", type=_positive_int, default=48)
    demo.add_argument("--max-tokens", type=_positive_int, default=32)
    demo.add_argument("--num-speculative-tokens", type=int, default=2)
    demo.add_argument("--attention-backend", default="torch", help="torch | triton")
    demo.add_argument("--num-blocks", type=_positive_int, default=48, help="KV pool size (small: shows preemption)")
    demo.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="servelab-demo", help="folder for the model and the report figure")
    blocks = sub.add_parser("blocks", help="run a serving workload through the KV block layer alone")
    blocks.add_argument("--num-requests", type=_positive_int, default=64)
    blocks.add_argument("--num-blocks", type=_positive_int, default=96)
    blocks.add_argument("--block-size", type=_positive_int, default=16)
    blocks.add_argument("--token-budget", type=_positive_int, default=256)
    blocks.add_argument("--seed", type=int, default=0)
    blocks.add_argument("--out", default="servelab-demo", help="folder for the figure")
    sim = sub.add_parser("simulate", help="compare scheduling policies on one simulated workload")
    sim.add_argument("--policy", default="fcfs,priority,sjf,vtc", help="comma-separated policy names")
    sim.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (inf: all at once)")
    sim.add_argument("--num-requests", type=_positive_int, default=1000)
    sim.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    sim.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (< 1: burstier than Poisson)")
    sim.add_argument("--prompt-len", default="lognormal:512:0.6", help="fixed:N | uniform:LO:HI | lognormal:MED:SIGMA")
    sim.add_argument("--output-len", default="lognormal:128:0.6")
    sim.add_argument("--num-prefix-groups", type=int, default=0, help="shared system prompts")
    sim.add_argument("--prefix-len", type=int, default=0)
    sim.add_argument("--num-clients", type=_positive_int, default=1)
    sim.add_argument("--client-skew", type=float, default=0.0, help="client k sends a share ~ 1/(k+1)^skew")
    sim.add_argument("--num-priorities", type=_positive_int, default=1)
    sim.add_argument("--trace", help="CSV trace (prompt_len, output_len[, arrival_time, client_id, priority])")
    sim.add_argument("--num-blocks", type=_positive_int, default=4096)
    sim.add_argument("--block-size", type=_positive_int, default=16)
    sim.add_argument("--no-prefix-caching", action="store_true")
    sim.add_argument("--max-num-seqs", type=_positive_int, default=256)
    sim.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048)
    sim.add_argument("--max-model-len", type=_positive_int, default=8192)
    sim.add_argument("--long-prefill-token-threshold", type=int, default=0)
    sim.add_argument("--cost-model", default="0.009,7e-5,3.5e-7",
                     help="seconds per step: BASE,PER_TOKEN,PER_KV_TOKEN")
    sim.add_argument("--ttft-slo", type=float, default=1.0, help="seconds, for goodput")
    sim.add_argument("--tpot-slo", type=float, default=0.1, help="seconds, for goodput")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--out", default="servelab-simulate", help="folder for the CSV table and the figure")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command == "blocks":
        return _blocks(args)
    if args.command == "simulate":
        return _simulate(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
