"""pytest-benchmark -> ``bench/results/results.csv``: one row per benchmark.

Every passing test that used the ``benchmark`` fixture appends one row
(``results_io.make_row``): the median time of a round in microseconds as
``value`` / ``p50``, with ``p20`` / ``p80`` over the rounds. Which row:

- ``component``: the module's ``RESULTS_COMPONENT`` (default: the file name
  without ``bench_``);
- ``implementation``: ``benchmark.extra_info["implementation"]``, else the
  test's ``impl`` parameter, else the module's ``RESULTS_IMPLEMENTATION``
  (default ``"servelab"``);
- ``metric``: ``benchmark.extra_info["metric"]``, else the test name without
  ``test_``; ``unit`` is ``us``;
- ``params``: the test's other parameters.

``--benchmark-disable`` records nothing (no stats); ``SERVELAB_RESULTS_CSV``
redirects rows (``0`` switches recording off), see ``results_io.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402


def row_for_benchmark(item, benchmark) -> dict | None:
    """The results row of one finished benchmark test, ``None`` without stats."""
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    data = list(getattr(stats, "data", None) or [])
    if not data:
        return None
    module = item.module
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    extra = benchmark.extra_info
    impl = extra.get("implementation") or params.pop("impl", None) or getattr(
        module, "RESULTS_IMPLEMENTATION", "servelab")
    params.pop("impl", None)
    component = getattr(module, "RESULTS_COMPONENT", Path(module.__file__).stem.removeprefix("bench_"))
    metric = extra.get("metric") or item.originalname.removeprefix("test_")
    q = results_io.percentiles(x * 1e6 for x in data)
    return results_io.make_row(component, str(impl), metric, "us", q["p50"], params=params, **q)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    benchmark = getattr(item, "funcargs", {}).get("benchmark")
    if report.when == "call" and report.passed and benchmark is not None:
        row = row_for_benchmark(item, benchmark)
        if row is not None:
            results_io.append_rows([row])
