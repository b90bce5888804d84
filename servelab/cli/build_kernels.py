"""``servelab build-kernels``: compile, verify and cache the C decode-attention kernel now.

A pipeline builds it when constructed anyway; this command does it ahead of
time (an image build, a shared home directory being prepared) and says what
it got: the library file, its cache key, the flags (``-march=native``,
``-fopenmp``) and whether it runs on several threads. Exit status 0 when the
kernel is ready, 1 when it cannot be built (the reason on stderr; servelab
then runs the torch formulation), 2 when it is switched off
(``SERVELAB_CPU_KERNELS=0``).
"""

from __future__ import annotations

import argparse
import os
import sys

ENV_SWITCH = "SERVELAB_CPU_KERNELS"  # servelab.attention.cpu_decode.ENV_SWITCH (not imported: no torch at start)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the subcommand on the ``servelab`` parser's subparsers."""
    sub.add_parser("build-kernels", help="compile, verify and cache the C decode-attention kernel now",
                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)


def run(args: argparse.Namespace) -> int:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        print(f"servelab build-kernels: error: the kernel is switched off ({ENV_SWITCH}=0)", file=sys.stderr)
        return 2
    from servelab.attention import cpu_kernel_build  # imports torch: only when the command runs

    try:
        built = cpu_kernel_build.load()
    except cpu_kernel_build.KernelBuildError as error:
        print(f"servelab build-kernels: the kernel cannot be built here ({error}); servelab uses the torch "
              "formulation", file=sys.stderr)
        return 1
    threads = "several threads (OpenMP)" if built.openmp else "one thread (no OpenMP)"
    print(f"decode-attention kernel ready: {built.path}\n  key {built.key}, flags {' '.join(built.flags)}, "
          f"runs on {threads}")
    return 0
