"""``servelab`` console script.

A user mistake (a bad option, a trace with a bad row, a model folder that is
not a checkpoint, a KV pool too small for any request) never prints a
traceback: the command exits with status 2 and one line on stderr naming what
is wrong (``servelab <command>: error: ...``). One exit rule for every command
(:func:`_failed_exit`): 0 every request served, 1 some requests failed (their
reasons are printed), 2 a usage error or every request failed, 130
interrupted (finished rows kept). Outputs are checked before the run, sizes
against the machine's memory, and an option that has no effect in the chosen
mode is refused (:mod:`servelab.cli.options`, :mod:`servelab.cli.bounds`).
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

from servelab.cli import build_kernels, serve
from servelab.cli.bounds import BYTES_PER_REQUEST, check_host_memory, simulate_parts
from servelab.cli.options import DefaultsHelpFormatter, OutputError, check_out_dir, check_out_file, explicit_options
from servelab.config import SchedulerConfig
from servelab.cli.sweep import add_sweep_parser, run_sweep_command

EPILOG = """\
examples:
  servelab demo                          the pipeline on the embedded tiny Llama
  servelab demo --model smollm2          the same on a real trained model (SmolLM2-135M-Instruct)
  servelab demo --model gemma3-270m      ... on Gemma 3 270M (5:1 local/global layers, hybrid KV groups)
  servelab demo --model PATH             any local HF Llama / Qwen2 / Mistral folder or .gguf file
  servelab simulate --policy fcfs,sjf    scheduling policies on a simulated trace
  servelab simulate --engine vllm        the same trace through vLLM's real scheduler
  servelab blocks                        the KV block layer alone under load
  servelab build-kernels                 compile and cache the C decode kernel ahead of time
  servelab sweep SPEC.toml [--executor ray]  a grid of cluster simulations (routers, replicas, rates)
  servelab serve smollm2 --port 8000     an OpenAI-compatible server (the 'serve' extra)
"""

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block): ``prog: error: message``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 600 else text[:597] + "..."


def _fail(command: str, message: str) -> int:
    print(f"servelab {command}: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def _failed_exit(command: str, failed: int, total: int, reason: str) -> int:
    """One exit rule for every command: 0 all served, 1 some requests failed, 2 every request failed."""
    if failed and failed == total:
        return _fail(command, f"all {total} requests failed: {reason}")
    if failed:
        print(f"servelab {command}: {failed} of {total} requests failed: {reason}", file=sys.stderr)
        return 1
    return 0


def _int_at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is invalid; valid: {what}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer (>= 1)")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _number(minimum: float, *, strict: bool, allow_inf: bool, what: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        ok = (value > minimum if strict else value >= minimum) and (math.isfinite(value) or
                                                                    (allow_inf and value == math.inf))
        if not ok:
            raise argparse.ArgumentTypeError(f"{text} is invalid; valid: {what}")
        return value

    return parse


_rate = _number(0.0, strict=True, allow_inf=True, what="a number > 0 (inf: all requests at once)")
_positive_float = _number(0.0, strict=True, allow_inf=False, what="a finite number > 0")
_non_negative_float = _number(0.0, strict=False, allow_inf=False, what="a finite number >= 0")


def _load_errors() -> tuple[type[BaseException], ...]:
    """What a bad checkpoint raises: ValueError/OSError, and safetensors' own error type."""
    errors: list[type[BaseException]] = [ValueError, OSError]
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:
        pass
    return tuple(errors)


def _demo(args: argparse.Namespace) -> int:
    import torch

    from servelab.cli.demo import resolve_demo_model, run_pipeline_demo

    try:
        check_host_memory([(f"--num-requests {args.num_requests}", args.num_requests * 4 * BYTES_PER_REQUEST)])
        out = check_out_dir(args.out)
    except ValueError as exc:  # too big for this machine, or an output that cannot be written
        return _fail("demo", _one_line(exc))
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, note = resolve_demo_model(args.model, out)
    except (*_load_errors(), ImportError, RuntimeError) as exc:  # not a checkpoint, missing extra, offline
        return _fail("demo", _one_line(exc))
    print(f"servelab demo: {args.num_requests} chat requests over 3 shared system prompts on {model}, "
          f"attention backend {args.attention_backend!r}, n-gram speculation with {args.num_speculative_tokens} drafts")
    print(note + "\n")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # matplotlib's empty-legend notes on a failed run
            metrics, figure, outputs = run_pipeline_demo(
                model, out, num_requests=args.num_requests, max_tokens=args.max_tokens,
                num_speculative_tokens=args.num_speculative_tokens, attention_backend=args.attention_backend,
                num_blocks=args.num_blocks, seed=args.seed)
    except (*_load_errors(), TypeError) as exc:  # a model, a file or a setting the pipeline refuses
        return _fail("demo", _one_line(exc))
    except (MemoryError, RuntimeError) as exc:  # an allocation the machine cannot make (torch raises RuntimeError)
        return _fail("demo", f"{_one_line(exc)[:300]}; --num-blocks {args.num_blocks} (or the model) does not fit "
                             "this machine's memory: lower --num-blocks")
    print(metrics.table())
    errors = list(getattr(metrics, "errors", []))
    if errors:
        print(f"\nerrors ({len(errors)}):")
        for message in errors:
            print(f"  {message}")
    print(f"\nfirst output: {outputs[0].text!r} ({outputs[0].finish_reason})")
    print(f"report figure: {figure}")
    return _failed_exit("demo", metrics.num_errors, len(outputs), errors[0] if errors else "see the errors above")


def _blocks(args: argparse.Namespace) -> int:
    from servelab.cli.demo import plot_block_demo, run_block_demo

    if args.num_blocks < 2:
        return _fail("blocks", f"--num-blocks {args.num_blocks} is too small; valid: >= 2 (block 0 is the null "
                               "block, so at least one more is needed to hold anything)")
    try:
        check_host_memory(simulate_parts(args.num_requests, "fixed:256", args.num_blocks))
        out = check_out_dir(args.out)
    except ValueError as exc:  # too big for this machine, or an output that cannot be written
        return _fail("blocks", _one_line(exc))
    print(f"servelab blocks: {args.num_requests} requests sharing 4 system prompts, "
          f"{args.num_blocks} KV blocks of {args.block_size} tokens, {args.token_budget} tokens per step\n")
    try:
        result = run_block_demo(args.num_requests, args.num_blocks, args.block_size, args.token_budget, args.seed)
    except ValueError as exc:
        return _fail("blocks", _one_line(exc))
    print(result.table())
    figure = plot_block_demo(result, out / "block_demo.png")
    print(f"\nfigure: {figure}")
    if result.leaked_blocks:
        print(f"servelab blocks: error: {result.leaked_blocks} blocks leaked", file=sys.stderr)
        return 1
    return _failed_exit("blocks", result.failed, args.num_requests,
                        f"the KV pool ({args.num_blocks} blocks of {args.block_size} tokens) cannot hold a request; "
                        "raise --num-blocks")


def _parse_policies(text: str, engine: str) -> list[str]:
    from servelab.scheduling.policies import available_policies

    valid = available_policies() + (["vllm-fcfs", "vllm-priority"] if engine == "vllm" else [])
    names = [p.strip() for p in text.split(",")]
    if not text.strip() or not all(names):
        raise ValueError(f"--policy {text!r} names no policy; valid: comma-separated names from {', '.join(valid)}")
    unknown = [p for p in names if p not in valid]
    if unknown:
        raise ValueError(f"--policy {', '.join(unknown)} is not known; valid: {', '.join(valid)}")
    return names


def _parse_cost_model(text: str):
    from servelab.scheduling.simulator import StepCostModel

    parts = text.split(",")
    try:
        values = [float(x) for x in parts]
    except ValueError:
        values = []
    if len(values) != 3:
        raise ValueError(f"--cost-model {text!r} is invalid; valid: three numbers BASE,PER_TOKEN,PER_KV_TOKEN "
                         "(seconds)")
    return StepCostModel(*values)


def _check_lengths(workload, max_model_len: int, engine: str):
    """The workload as requests, refused up front when no prompt fits ``max_model_len``."""
    from servelab.scheduling.simulator import generate_workload
    from servelab.scheduling.simulator.workload import WorkloadSpec

    requests = generate_workload(workload) if isinstance(workload, WorkloadSpec) else list(workload)
    # vLLM needs room for one sampled token after the prompt; servelab takes a prompt of max_model_len.
    limit = max_model_len - 1 if engine == "vllm" else max_model_len
    shortest = min((len(r.prompt_token_ids) for r in requests), default=0)
    if requests and shortest > limit:
        raise ValueError(f"every prompt is longer than --max-model-len {max_model_len} allows (shortest: "
                         f"{shortest} tokens); raise --max-model-len or shorten --prompt-len")
    return requests


def _simulate_inputs(args: argparse.Namespace):
    """Everything ``simulate`` needs, every check made before the first policy runs."""
    from servelab.cli.simulate_io import read_trace, refuse_inapplicable
    from servelab.scheduling import SchedulerConfig
    from servelab.scheduling.simulator import LengthDist, StepCostModel, WorkloadSpec

    refuse_inapplicable(args, getattr(args, "explicit", set()))
    check_host_memory(simulate_parts(0 if args.trace else args.num_requests, args.prompt_len, args.num_blocks))
    policies = _parse_policies(args.policy, args.engine)
    cost = _parse_cost_model(args.cost_model)
    config = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                             max_model_len=args.max_model_len,
                             long_prefill_token_threshold=args.long_prefill_token_threshold)
    if args.hardware:
        cost = StepCostModel.for_hardware(args.hardware, args.model)
    if args.engine == "vllm":
        import servelab.integrations.vllm  # noqa: F401  (fails here, with the install recipe, if absent)
    out = check_out_dir(args.out)
    table = check_out_file(out / "simulate.csv", "--out's simulate.csv", results_csv=True)
    if args.trace:
        workload, what = read_trace(args)
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
    requests = _check_lengths(workload, args.max_model_len, args.engine)
    return policies, cost, config, requests, what, out, table


def _simulate(args: argparse.Namespace) -> int:
    """Each policy's rows are appended to OUT/simulate.csv as soon as it finishes (a Ctrl-C keeps them)."""
    from servelab.cli.simulate_io import describe_params, write_results
    from servelab.scheduling.simulator import compare_policies, format_client_table, format_table, plot_results

    try:
        policies, cost, config, requests, what, out, table = _simulate_inputs(args)
    except (ValueError, TypeError, OSError, ImportError) as exc:
        return _fail("simulate", _one_line(exc))
    print(f"servelab simulate: {what}; {args.num_blocks} KV blocks of {args.block_size} tokens; "
          f"{args.engine} scheduler\n", flush=True)
    results = []
    try:
        for policy in policies:
            result, = compare_policies(requests, [policy], scheduler_config=config, num_blocks=args.num_blocks,
                                       block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                                       cost_model=cost, ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo,
                                       engine=args.engine)
            results.append(result)
            write_results([result], table, describe_params(args))
    except (ValueError, TypeError, OSError, ImportError) as exc:
        kept = f" ({len(results)} finished policies kept in {table})" if results else ""
        return _fail("simulate", _one_line(exc) + kept)
    except KeyboardInterrupt:
        print(f"servelab simulate: interrupted after {len(results)} of {len(policies)} policies; their rows are "
              f"kept in {table}", file=sys.stderr)
        return 130
    print(format_table(results))
    if args.num_clients > 1 or args.trace:
        print()
        print(format_client_table(results))
    figure = plot_results(results, out / "simulate.png", title=what)
    print(f"\ntable: {table}\nfigure: {figure}")
    failed, total = sum(r.num_failed for r in results), sum(len(r.requests) for r in results)
    reason = (f"the KV cache ({args.num_blocks} blocks of {args.block_size} tokens) cannot hold them; raise "
              "--num-blocks")
    if failed and failed == total:
        return _fail("simulate", f"every request failed under every policy: {reason}")
    return _failed_exit("simulate", failed, total, reason)


_SEED_HELP = "random seed (an integer >= 0)"


def _add_demo_parser(sub: argparse._SubParsersAction) -> None:
    """``servelab demo``: the full pipeline on a workload."""
    demo = sub.add_parser("demo", help="serve a workload through the full pipeline and report metrics",
                          formatter_class=DefaultsHelpFormatter)
    demo.add_argument("--model", help="'smollm2' (a real 135M chat model) or 'gemma3-270m' (Gemma 3 270M), "
                                      "fetched once; a local HF checkpoint "
                                      "folder or .gguf file (default: the embedded tiny Llama, random weights)")
    demo.add_argument("--num-requests", type=_positive_int, default=48, help="chat requests to serve")
    demo.add_argument("--max-tokens", type=_positive_int, default=32,
                      help="most tokens a request generates (each draws from MAX/2..MAX)")
    demo.add_argument("--num-speculative-tokens", type=_non_negative_int, default=2,
                      help="n-gram draft tokens per step (0: no speculation)")
    demo.add_argument("--attention-backend", default="auto",
                      help="auto (sdpa on a CPU, triton on CUDA) | torch (the references) | sdpa | triton")
    demo.add_argument("--num-blocks", type=_positive_int, default=48,
                      help="KV pool size in blocks, null block included (small: shows preemption)")
    demo.add_argument("--threads", type=_non_negative_int, default=1, help="torch threads (0: torch's default)")
    demo.add_argument("--seed", type=_non_negative_int, default=0, help=_SEED_HELP)
    demo.add_argument("--out", default="servelab-demo", help="folder for the model and the report figure")


def _add_blocks_parser(sub: argparse._SubParsersAction) -> None:
    """``servelab blocks``: a workload through the KV block layer alone."""
    blocks = sub.add_parser("blocks", help="run a serving workload through the KV block layer alone",
                            formatter_class=DefaultsHelpFormatter)
    blocks.add_argument("--num-requests", type=_positive_int, default=64, help="requests to serve")
    blocks.add_argument("--num-blocks", type=_positive_int, default=96,
                        help="KV pool size in blocks, null block included (>= 2)")
    blocks.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    blocks.add_argument("--token-budget", type=_positive_int, default=256, help="tokens computed per step")
    blocks.add_argument("--seed", type=_non_negative_int, default=0, help=_SEED_HELP)
    blocks.add_argument("--out", default="servelab-demo", help="folder for the figure")


def _add_workload_options(sim: argparse.ArgumentParser) -> None:
    """The generated workload's options (refused with --trace: a trace brings its own)."""
    sim.add_argument("--rate", type=_rate, default=8.0, help="mean arrivals per second (inf: all at once); with "
                                                            "--trace only for a CSV without arrival times")
    sim.add_argument("--num-requests", type=_positive_int, default=1000,
                     help="requests generated, or the first N of --trace")
    sim.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson", help="arrival process")
    sim.add_argument("--burstiness", type=_positive_float, default=1.0,
                     help="gamma shape (< 1: burstier than Poisson)")
    sim.add_argument("--prompt-len", default="lognormal:512:0.6",
                     help="prompt tokens: fixed:N | uniform:LO:HI | lognormal:MED:SIGMA")
    sim.add_argument("--output-len", default="lognormal:128:0.6", help="output tokens, same forms as --prompt-len")
    sim.add_argument("--num-prefix-groups", type=_non_negative_int, default=0, help="shared system prompts")
    sim.add_argument("--prefix-len", type=_non_negative_int, default=0, help="tokens of each shared system prompt")
    sim.add_argument("--num-clients", type=_positive_int, default=1, help="clients sending requests")
    sim.add_argument("--client-skew", type=_non_negative_float, default=0.0,
                     help="client k sends a share ~ 1/(k+1)^skew")
    sim.add_argument("--num-priorities", type=_positive_int, default=1, help="priority levels drawn uniformly")
    sim.add_argument("--seed", type=_non_negative_int, default=0, help=_SEED_HELP)


def _add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    """``servelab simulate``: scheduling policies on one simulated workload or trace."""
    sim = sub.add_parser("simulate", help="compare scheduling policies on one simulated workload",
                         formatter_class=DefaultsHelpFormatter,
                         description="Options that have no effect in the chosen mode (a generator option with "
                                     "--trace, --model without --hardware ...) are refused, not ignored.")
    sim.add_argument("--policy", default="fcfs,priority,sjf,vtc", help="comma-separated policy names")
    sim.add_argument("--engine", choices=["servelab", "vllm"], default="servelab",
                     help="whose scheduler serves the trace: servelab's, or vLLM's real v1 scheduler with the "
                          "policy bridged in (vllm-fcfs / vllm-priority: vLLM's own policies)")
    _add_workload_options(sim)
    sim.add_argument("--trace", help="a shipped trace (mooncake_conversation, azure_conv), a Mooncake .jsonl, an "
                                     "Azure .csv (with --trace-format azure) or a CSV trace (prompt_len, output_len[, "
                                     "arrival_time, client_id, priority])")
    sim.add_argument("--trace-format", choices=["mooncake", "azure", "csv"],
                     help="default: the shipped trace's own, .jsonl: mooncake, else csv")
    sim.add_argument("--time-scale", type=_positive_float, default=1.0,
                     help="multiply a Mooncake / Azure trace's arrival times (0.5: twice as fast)")
    sim.add_argument("--hardware", help="roofline step costs on this hardware (A100-80GB, H100-SXM, H200, L40S, "
                                        "MI300X, cpu-measured) instead of --cost-model")
    sim.add_argument("--model", default="llama-3.1-8b",
                     help="with --hardware: a model preset (llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, smollm2-135m)")
    sim.add_argument("--num-blocks", type=_positive_int, default=4096, help="KV pool size in blocks")
    sim.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    sim.add_argument("--no-prefix-caching", action="store_true", help="switch prefix caching off")
    # SchedulerConfig's defaults: servelab's one set of scheduling defaults
    sim.add_argument("--max-num-seqs", type=_positive_int, default=SchedulerConfig.max_num_seqs,
                     help="most requests running at once")
    sim.add_argument("--max-num-batched-tokens", type=_positive_int, default=SchedulerConfig.max_num_batched_tokens,
                     help="token budget of a step")
    sim.add_argument("--max-model-len", type=_positive_int, default=SchedulerConfig.max_model_len,
                     help="longest request (prompt + output); a trace's longer requests are clipped to it")
    sim.add_argument("--long-prefill-token-threshold", type=_non_negative_int, default=0,
                     help="cap on one request's prefill tokens per step (0: no cap)")
    sim.add_argument("--cost-model", default="0.009,7e-5,3.5e-7",
                     help="seconds per step: BASE,PER_TOKEN,PER_KV_TOKEN")
    sim.add_argument("--ttft-slo", type=_positive_float, default=1.0, help="seconds, for goodput")
    sim.add_argument("--tpot-slo", type=_positive_float, default=0.1, help="seconds, for goodput")
    sim.add_argument("--out", default="servelab-simulate", help="folder for the CSV table and the figure")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(
        prog="servelab",
        description="servelab: a kernel-first research toolkit for LLM serving.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    _add_demo_parser(sub)
    _add_blocks_parser(sub)
    _add_simulate_parser(sub)
    build_kernels.add_parser(sub)
    add_sweep_parser(sub)
    serve.add_parser(sub)
    args = parser.parse_args(argv)
    args.explicit = explicit_options(parser, argv)  # what the user typed: options a mode ignores are refused
    commands = {"demo": _demo, "blocks": _blocks, "simulate": _simulate, "build-kernels": build_kernels.run,
                "sweep": run_sweep_command, "serve": serve.run}
    if args.command not in commands:
        parser.print_help()
        return 0
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        print(f"servelab {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a file or folder that went away or filled up mid-run: one line, not a traceback
        return _fail(args.command, f"{_one_line(exc)} (rows finished before it are kept)")


if __name__ == "__main__":
    sys.exit(main())
