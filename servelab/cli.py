"""``servelab`` console script."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

COMING = """\
coming next (see the project's issues):
  servelab demo --model PATH   the full pipeline on a tiny Llama checkpoint
  servelab simulate ...         scheduler policies compared on a trace
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
    from servelab.demo import plot_block_demo, run_block_demo

    print(f"servelab demo: {args.num_requests} requests sharing 4 system prompts, "
          f"{args.num_blocks} KV blocks of {args.block_size} tokens, {args.token_budget} tokens per step\n")
    result = run_block_demo(args.num_requests, args.num_blocks, args.block_size, args.token_budget, args.seed)
    print(result.table())
    figure = plot_block_demo(result, Path(args.out) / "block_demo.png")
    print(f"\nfigure: {figure}")
    if result.leaked_blocks:
        print(f"error: {result.leaked_blocks} blocks leaked", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="servelab",
        description="servelab: a kernel-first research toolkit for LLM serving.",
        epilog=COMING,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="run a serving workload through the KV block layer and report")
    demo.add_argument("--num-requests", type=_positive_int, default=64)
    demo.add_argument("--num-blocks", type=_positive_int, default=96)
    demo.add_argument("--block-size", type=_positive_int, default=16)
    demo.add_argument("--token-budget", type=_positive_int, default=256)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="servelab-demo", help="folder for the figure")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
