"""Simulator: workloads, cost model, metrics, policy comparisons, report, CLI."""

from __future__ import annotations

import math

import numpy as np
import pytest

from servelab.cli import main
from servelab.scheduling import SchedulerConfig
from servelab.scheduling.simulator import (
    LengthDist,
    StepCostModel,
    WorkloadSpec,
    compare_policies,
    format_client_table,
    format_table,
    generate_workload,
    load_trace_csv,
    plot_results,
    simulate,
    write_csv,
)

SMALL = dict(num_requests=300, rate=20.0, prompt_len=LengthDist("uniform", 16, 256),
             output_len=LengthDist("uniform", 4, 64))


def test_workloads_are_reproducible_from_the_seed():
    a = generate_workload(WorkloadSpec(**SMALL, seed=3))
    b = generate_workload(WorkloadSpec(**SMALL, seed=3))
    c = generate_workload(WorkloadSpec(**SMALL, seed=4))
    assert a == b and a != c


@pytest.mark.parametrize(("arrival", "shape"), [("poisson", 1.0), ("gamma", 0.25), ("gamma", 4.0)])
def test_arrival_processes_have_the_asked_rate_and_burstiness(arrival, shape):
    reqs = generate_workload(WorkloadSpec(num_requests=6000, rate=5.0, arrival=arrival, burstiness=shape, seed=1,
                                          prompt_len=LengthDist("fixed", 4), output_len=LengthDist("fixed", 1)))
    gaps = np.diff([0.0] + [r.arrival_time for r in reqs])
    assert gaps.mean() == pytest.approx(0.2, rel=0.06)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1.0 / shape, rel=0.15)  # CV^2 of gamma gaps


def test_length_distributions_and_parsing():
    rng = np.random.default_rng(0)
    assert set(LengthDist.parse("fixed:7").sample(rng, 50)) == {7}
    assert LengthDist.parse("12") == LengthDist("fixed", 12)
    u = LengthDist.parse("uniform:3:9").sample(rng, 2000)
    assert u.min() == 3 and u.max() == 9
    ln = LengthDist.parse("lognormal:100:0.5").sample(rng, 20000)
    assert np.median(ln) == pytest.approx(100, rel=0.05)
    for bad in ("gauss:1:2", "uniform:9:3", "fixed:x", "lognormal:0:1"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_shared_prefix_groups_and_clients():
    spec = WorkloadSpec(num_requests=400, rate=10, num_prefix_groups=3, prefix_len=32, num_clients=3,
                        client_weights=(6, 3, 1), prompt_len=LengthDist("fixed", 8), seed=2)
    reqs = generate_workload(spec)
    assert len({tuple(r.prompt_token_ids[:32]) for r in reqs}) == 3
    assert all(len(r.prompt_token_ids) == 40 for r in reqs)
    shares = np.bincount([int(r.client_id.split("-")[1]) for r in reqs]) / 400
    assert shares == pytest.approx([0.6, 0.3, 0.1], abs=0.06)
    with pytest.raises(ValueError, match="prefix_len"):
        WorkloadSpec(num_prefix_groups=2)
    with pytest.raises(ValueError, match="rate"):
        WorkloadSpec(rate=0)


def test_csv_traces(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("arrival_time,prompt_len,output_len,client_id,priority,prefix_group,prefix_len\n"
                    "0.5,10,3,x,1,g,8\n0.1,12,2,y,0,g,8\n0.9,5,1,x,0,,\n")
    reqs = load_trace_csv(path)
    assert [r.arrival_time for r in reqs] == [0.1, 0.5, 0.9]
    assert reqs[0].prompt_token_ids[:8] == reqs[1].prompt_token_ids[:8]
    assert [len(r.prompt_token_ids) for r in reqs] == [12, 10, 5] and reqs[0].client_id == "y"
    no_time = tmp_path / "lengths.csv"
    no_time.write_text("input_len,output_len\n4,2\n6,3\n")
    with pytest.raises(ValueError, match="rate="):
        load_trace_csv(no_time)
    assert len(load_trace_csv(no_time, rate=2.0)) == 2
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt_len\n4\n")
    with pytest.raises(ValueError, match="output_len"):
        load_trace_csv(bad)
    result = simulate(reqs, "fcfs", num_blocks=64)
    assert len(result.requests) == 3
    # A prompt over max_model_len is refused by the scheduler: failed, not a crash.
    result = simulate(reqs, "fcfs", num_blocks=64, scheduler_config=SchedulerConfig(max_model_len=11))
    assert result.num_failed == 1 and len(result.requests) == 3


def test_cost_model_fit_recovers_coefficients_and_stays_non_negative():
    rng = np.random.default_rng(0)
    true = StepCostModel(0.01, 5e-5, 2e-7)
    tokens = rng.integers(1, 4096, 200)
    kv = rng.integers(1, 200_000, 200)
    secs = [true.step_time(t, k) * (1 + rng.normal(0, 0.01)) for t, k in zip(tokens, kv)]
    fit = StepCostModel.fit(list(zip(tokens, kv, secs)))
    assert fit.base_s == pytest.approx(0.01, rel=0.1)
    assert fit.per_token_s == pytest.approx(5e-5, rel=0.05)
    assert fit.per_kv_token_s == pytest.approx(2e-7, rel=0.05)
    # Data an unconstrained fit would explain with a negative slope.
    fit = StepCostModel.fit([(1, 0, 1.0), (2, 0, 0.9), (3, 0, 0.8)])
    assert fit.per_token_s == 0 and fit.base_s == pytest.approx(0.9)
    with pytest.raises(ValueError):
        StepCostModel.fit([(1, 2, 3)])
    with pytest.raises(ValueError, match="base_s"):
        StepCostModel(base_s=-1)


def test_a_simulation_serves_every_request_and_is_deterministic():
    spec = WorkloadSpec(**SMALL, num_prefix_groups=4, prefix_len=64, seed=5)
    a = simulate(spec, "fcfs", num_blocks=512)
    b = simulate(spec, "fcfs", num_blocks=512)
    assert len(a.requests) == 300 and a.num_failed == 0
    assert [m.finish_time for m in a.requests] == [m.finish_time for m in b.requests]
    s = a.summary()
    assert 0 < s["ttft_p50"] <= s["ttft_p90"] <= s["ttft_p99"]
    assert s["throughput_tok_s"] > 0 and 0 <= s["slo_attainment"] <= 1
    assert 0.1 < a.prefix_hit_rate < 1, "shared prefixes must be found in the cache"
    assert a.kv_usage.max() <= 1.0 and a.kv_times.size == a.num_steps
    no_cache = simulate(spec, "fcfs", num_blocks=512, enable_prefix_caching=False)
    assert no_cache.prefix_hit_rate == 0
    # Every output token has a time; ITL gaps are one per token after the first.
    assert a.itl.size == sum(m.num_output_tokens - 1 for m in a.requests)


def test_tight_memory_forces_preemption_and_everything_still_ends():
    result = simulate(WorkloadSpec(**SMALL, seed=6), "fcfs", num_blocks=48, block_size=16)
    assert result.num_preemptions > 0
    assert len(result.requests) == 300 and result.num_failed == 0


def test_policies_behave_as_their_names_say_under_overload():
    spec = WorkloadSpec(num_requests=400, rate=math.inf, prompt_len=LengthDist("uniform", 16, 512),
                        output_len=LengthDist("fixed", 8), num_priorities=3, seed=7)
    config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=2048)
    fcfs, prio, sjf = compare_policies(spec, ["fcfs", "priority", "sjf"], scheduler_config=config,
                                       num_blocks=1024)
    assert sjf.latency("ttft").mean < 0.8 * fcfs.latency("ttft").mean
    by_prio = {p: np.mean([m.ttft for m in prio.requests if m.priority == p]) for p in range(3)}
    assert by_prio[0] < by_prio[1] < by_prio[2]


def test_vtc_evens_out_service_between_a_heavy_and_a_light_client():
    spec = WorkloadSpec(num_requests=400, rate=math.inf, num_clients=2, client_weights=(9, 1),
                        prompt_len=LengthDist("fixed", 64), output_len=LengthDist("fixed", 16), seed=8)
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=1024)
    fcfs, vtc = compare_policies(spec, ["fcfs", "vtc"], scheduler_config=config, num_blocks=512)
    light = "client-1"
    ttft = {r.policy: np.mean([m.ttft for m in r.requests if m.client_id == light]) for r in (fcfs, vtc)}
    assert ttft["vtc"] < 0.5 * ttft["fcfs"], "fair share must serve the light client early"
    assert light in format_client_table([fcfs, vtc])


def test_report_table_csv_and_figure(tmp_path):
    results = compare_policies(WorkloadSpec(**SMALL, seed=9), ["fcfs", "sjf"], num_blocks=256)
    table = format_table(results)
    assert "TTFT p99 s" in table and "sjf" in table.splitlines()[2]
    assert write_csv(results, tmp_path / "t.csv").read_text().startswith("policy,")
    assert plot_results(results, tmp_path / "f.png").stat().st_size > 10_000


def test_cli_simulate_compares_policies_and_writes_table_and_figure(tmp_path, capsys):
    code = main(["simulate", "--policy", "fcfs,vtc", "--num-requests", "80", "--rate", "30", "--num-clients", "2",
                 "--prompt-len", "uniform:16:128", "--output-len", "fixed:8", "--num-blocks", "256",
                 "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "vtc" in out and "client-1" in out
    assert (tmp_path / "simulate.csv").exists() and (tmp_path / "simulate.png").stat().st_size > 10_000
    assert main(["simulate", "--policy", "nope", "--num-requests", "5", "--out", str(tmp_path)]) == 2
    assert "valid:" in capsys.readouterr().err


# ---- bad workloads are refused before the clock starts --------------------------------------


def test_traces_are_validated_before_simulation():
    from servelab.scheduling.simulator import TraceRequest, validate_trace

    good = TraceRequest("a", 0.0, [1, 2], 3)
    validate_trace([good])
    for bad, field_name in [(TraceRequest("b", math.nan, [1], 1), "arrival_time"),
                            (TraceRequest("b", math.inf, [1], 1), "arrival_time"),
                            (TraceRequest("b", -0.5, [1], 1), "arrival_time"),
                            (TraceRequest("b", 1.0, [], 1), "empty prompt"),
                            (TraceRequest("b", 1.0, [1], 0), "max_tokens"),
                            (TraceRequest("a", 1.0, [1], 1), "duplicate")]:
        with pytest.raises(ValueError, match=field_name) as info:
            simulate([good, bad], "fcfs", num_blocks=64)  # a NaN arrival used to hang here
        assert "workload[1]" in str(info.value)


def test_csv_cells_are_checked_with_file_line_and_column(tmp_path):
    cases = {"0.1,10,3\nnan,12,2\n": "line 3: column 'arrival_time'",
             "0.1,10,3\n0.2,12\n": "line 3: column 'output_len' is empty",
             "0.1,10,3,7\n": "line 2: 4 cells",
             "0.1,0,3\n": "line 2: column 'prompt_len'",
             "0.1,10,2.5\n": "line 2: column 'output_len' = '2.5' is not an integer"}
    for i, (rows, message) in enumerate(cases.items()):
        path = tmp_path / f"t{i}.csv"
        path.write_text("arrival_time,prompt_len,output_len\n" + rows)
        with pytest.raises(ValueError, match=message):
            load_trace_csv(path)
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("prompt_len,output_len\n4,2\n")
    for rate in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match="rate="):
            load_trace_csv(lengths, rate=rate)


def test_a_run_whose_last_arrivals_are_all_refused_ends_cleanly():
    reqs = generate_workload(WorkloadSpec(num_requests=20, rate=5, prompt_len=LengthDist("fixed", 600),
                                          output_len=LengthDist("fixed", 4), seed=1))
    result = simulate(reqs, "fcfs", num_blocks=64, scheduler_config=SchedulerConfig(max_model_len=512))
    assert result.num_failed == 20 and len(result.requests) == 20  # was an IndexError


def test_engine_and_policy_list_are_checked():
    spec = WorkloadSpec(**SMALL, seed=1)
    with pytest.raises(ValueError, match="engine="):
        simulate(spec, "fcfs", engine="tgi")
    with pytest.raises(ValueError, match="policies is empty"):
        compare_policies(spec, [])


def test_generated_prompts_are_compact_and_read_like_lists():
    from servelab.scheduling.simulator.workload import PrefixedTokens
    spec = WorkloadSpec(num_requests=20, rate=10.0, num_prefix_groups=2, prefix_len=8, seed=3)
    reqs = generate_workload(spec)
    p = reqs[5].prompt_token_ids
    assert isinstance(p, PrefixedTokens)
    as_list = list(p)
    assert len(p) == len(as_list) and p == as_list and all(type(t) is int for t in as_list)
    assert all(a is b for a, b in zip(as_list, list(p))), "live prompts share one int object per id"
    assert [p[i] for i in range(len(p))] == as_list and p[-1] == as_list[-1] and p[2:11] == as_list[2:11]
    with pytest.raises(IndexError):
        p[len(p)]
    # the same spec gives the same tokens; prompts of one group share their prefix
    assert [list(r.prompt_token_ids) for r in generate_workload(spec)] == [list(r.prompt_token_ids) for r in reqs]
    same = [r for r in reqs if r.prompt_token_ids.prefix is p.prefix]
    assert len(same) > 1 and all(list(r.prompt_token_ids)[:8] == as_list[:8] for r in same)
