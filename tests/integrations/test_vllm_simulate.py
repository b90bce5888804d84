"""``servelab simulate --engine vllm``: the same trace, cost model and report through vLLM's real
scheduler (with a bridged servelab policy, or vLLM's own). Skipped without vLLM."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")

from servelab.cli import main  # noqa: E402
from servelab.scheduling.simulator import WorkloadSpec, simulate  # noqa: E402
from servelab.scheduling.simulator.workload import LengthDist  # noqa: E402

WORKLOAD = WorkloadSpec(num_requests=60, rate=40.0, prompt_len=LengthDist("uniform", 16, 96), output_len=LengthDist("uniform", 4, 24),
                        num_prefix_groups=2, prefix_len=32, num_clients=3, seed=3)


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "vtc", "vllm-fcfs"])
def test_vllm_engine_serves_the_trace_with_the_same_report(policy):
    result = simulate(WORKLOAD, policy, engine="vllm", num_blocks=64)
    ours = simulate(WORKLOAD, "fcfs" if policy == "vllm-fcfs" else policy, num_blocks=64)
    assert len(result.requests) == len(ours.requests) == WORKLOAD.num_requests
    assert all(m.finish_reason == "length" for m in result.requests)
    assert sum(m.num_output_tokens for m in result.requests) == sum(m.num_output_tokens for m in ours.requests)
    summary, reference = result.summary(), ours.summary()
    assert set(summary) == set(reference)  # the same report fields, whichever engine served the trace
    assert all(not isinstance(v, float) or math.isfinite(v) or math.isnan(v) for v in summary.values())


def test_a_request_that_can_never_fit_fails_instead_of_waiting_forever():
    spec = WorkloadSpec(num_requests=3, rate=math.inf, prompt_len=LengthDist("fixed", 200), output_len=LengthDist("fixed", 4), seed=0)
    result = simulate(spec, "fcfs", engine="vllm", num_blocks=8, block_size=16)
    assert [m.finish_reason for m in result.requests] == ["error"] * 3


def test_cli_runs_the_vllm_engine(tmp_path, capsys):
    code = main(["simulate", "--engine", "vllm", "--policy", "fcfs,sjf", "--num-requests", "40", "--rate", "20",
                 "--out", str(tmp_path)])
    assert code == 0
    assert any(tmp_path.iterdir())  # the CSV and figures, as for the servelab engine
    assert "sjf" in capsys.readouterr().out
