"""Command-line option types the benchmarks share (no servelab import: ``block_pool_vs_vllm.py`` also
runs in an environment that holds only vLLM)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def comma_separated(kind: type) -> Callable[[str], list]:
    """An argparse ``type`` for a comma-separated option of ``kind`` values > 0 (thread counts, batch
    sizes, arrival rates): ``"1,2"`` -> ``[1, 2]``; anything else is argparse's usage error naming the
    option, not a traceback."""

    def parse(text: str) -> list:
        try:
            values = [kind(part) for part in text.split(",")]
        except ValueError:
            values = []
        if not values or not all(v > 0 for v in values):
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected comma-separated {kind.__name__} values > 0, e.g. 1,2")
        return values

    parse.__name__ = f"comma-separated {kind.__name__}"
    return parse
