"""The command line never loses work, never runs away, never ignores what it was told.

Outputs are checked before the run; a sweep writes each point as it finishes and a Ctrl-C keeps
them; options that have no effect in the chosen mode are refused and never recorded; exit codes
agree across commands; every option has help and shows its default.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
import types

import pytest

from servelab.cli import main

SWEEP_SPEC = """
[workload]
num_requests = 6
rate = 50.0
prompt_len = "fixed:32"
output_len = "fixed:4"
[cluster]
num_blocks = 64
[grid]
router = ["round_robin", "least_loaded"]
replicas = [1, 2]
"""


def run_cli(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line(code, err, *needles, status=2):
    assert code == status, f"exit code {code}, stderr {err!r}"
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def sweep_spec(tmp_path, text=SWEEP_SPEC):
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return str(path)


# ---- outputs checked before the run ------------------------------------------------------------


@pytest.mark.parametrize("command", [
    ["simulate", "--num-requests", "5", "--policy", "fcfs"],
    ["blocks", "--num-requests", "4"],
    ["demo", "--num-requests", "2", "--max-tokens", "2"],
])
def test_out_naming_a_file_is_refused_before_the_run(tmp_path, capsys, command):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    start = time.perf_counter()
    code, out, err = run_cli(command + ["--out", str(taken)], capsys)
    assert_one_line(code, err, "--out", "is a file")
    assert out == "", "refused before the run printed (or did) anything"
    assert time.perf_counter() - start < 5
    assert taken.read_text() == "not a folder"


def test_out_under_a_file_is_refused_and_nothing_runs(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code, out, err = run_cli(["simulate", "--num-requests", "5", "--out", str(tmp_path / "file" / "sub")], capsys)
    assert_one_line(code, err, "--out", "cannot be created")
    assert out == ""


def test_sweep_outputs_are_checked_before_any_point_runs(tmp_path, capsys, monkeypatch):
    import servelab.cluster.sweep as sweep_module

    def must_not_run(*args, **kwargs):
        raise AssertionError("a point ran before the outputs were checked")

    monkeypatch.setattr(sweep_module, "iter_sweep", must_not_run)
    spec = sweep_spec(tmp_path)
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(["sweep", spec, "--out", str(tmp_path / "file")], capsys)
    assert_one_line(code, err, "--out", "is a file")
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    code, _, err = run_cli(["sweep", spec, "--out", str(tmp_path / "o"), "--results", str(bad)], capsys)
    assert_one_line(code, err, "--results", "header")
    code, _, err = run_cli(["sweep", spec, "--out", str(tmp_path / "o"), "--results", str(tmp_path)], capsys)
    assert_one_line(code, err, "--results", "is a folder")


# ---- sweeps: per-point writes, progress, Ctrl-C keeps finished points ----------------------------


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_sweep_writes_each_point_with_progress(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run_cli(["sweep", sweep_spec(tmp_path), "--jobs", "1", "--out", str(out)], capsys)
    assert code == 0, err
    progress = [line for line in stdout.splitlines() if line.strip().startswith("[")]
    assert [line.split("]")[0].strip() for line in progress] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert len(_read_csv(out / "sweep.csv")) == 4
    points = {json.dumps(json.loads(r["params"]), sort_keys=True) for r in _read_csv(out / "results.csv")}
    assert len(points) == 4


def test_ctrl_c_during_a_sweep_keeps_the_finished_points(tmp_path, capsys, monkeypatch):
    import servelab.cluster.sweep as sweep_module

    real = sweep_module.iter_sweep

    def interrupted_after_two(points, *args, **kwargs):
        for done, item in enumerate(real(points, *args, **kwargs)):
            if done == 2:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(sweep_module, "iter_sweep", interrupted_after_two)
    out = tmp_path / "out"
    code, _, err = run_cli(["sweep", sweep_spec(tmp_path), "--jobs", "1", "--out", str(out)], capsys)
    assert code == 130
    assert "interrupted after 2 of 4 points" in err
    assert len(_read_csv(out / "sweep.csv")) == 2
    routers = {r["implementation"] for r in _read_csv(out / "results.csv")}
    assert routers == {"round_robin"}, "the two finished points' rows are kept"
    assert (out / "sweep.png").stat().st_size > 1000


def test_iter_sweep_yields_each_point_before_the_next_fails():
    from servelab.cluster.sweep import iter_sweep

    def task(point):
        if point["x"] == 2:
            raise KeyboardInterrupt
        return {"x": point["x"]}

    seen = []
    with pytest.raises(KeyboardInterrupt):
        for index, row in iter_sweep([{"x": 0}, {"x": 1}, {"x": 2}, {"x": 3}], jobs=1, task=task):
            seen.append((index, row["x"]))
    assert seen == [(0, 0), (1, 1)]


def test_an_empty_sweep_spec_is_refused(tmp_path, capsys):
    code, _, err = run_cli(["sweep", sweep_spec(tmp_path, ""), "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, "empty")


# ---- Ray: a missing cluster or client is one line naming --address ---------------------------------


def _fake_ray(error: BaseException) -> types.ModuleType:
    ray = types.ModuleType("ray")

    def init(**kwargs):
        raise error

    ray.init = init  # type: ignore[attr-defined]
    ray.is_initialized = lambda: False  # type: ignore[attr-defined]
    return ray


@pytest.mark.parametrize(("error", "needles"), [
    (ConnectionError("Could not find any running Ray instance."), ["--address 'auto'", "no Ray cluster"]),
    (ValueError("Ray Client requires pip package `ray[client]`."), ["--address", "servelab[ray]"]),
])
def test_ray_address_without_a_cluster_is_one_line(tmp_path, capsys, monkeypatch, error, needles):
    monkeypatch.setitem(sys.modules, "ray", _fake_ray(error))
    code, _, err = run_cli(["sweep", sweep_spec(tmp_path), "--executor", "ray", "--address", "auto",
                            "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, *needles)


# ---- nothing ignored ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "needles"), [
    (["--trace", "mooncake_conversation", "--rate", "1000"], ["--rate", "no effect"]),
    (["--trace", "azure_conv", "--prompt-len", "fixed:8", "--arrival", "gamma"], ["--arrival, --prompt-len"]),
    (["--trace", "azure_conv", "--burstiness", "0.5"], ["--burstiness"]),
    (["--trace", "mooncake_conversation", "--trace-format", "azure"], ["--trace-format azure", "mooncake"]),
    (["--model", "llama-3.1-70b"], ["--model", "--hardware"]),
    (["--hardware", "H100-SXM", "--cost-model", "0.01,1e-4,1e-7"], ["--hardware and --cost-model"]),
    (["--time-scale", "2"], ["--time-scale", "--trace only"]),
])
def test_options_without_effect_are_refused(tmp_path, capsys, extra, needles):
    code, _, err = run_cli(["simulate", "--num-requests", "5", "--policy", "fcfs", "--out", str(tmp_path)] + extra,
                           capsys)
    assert_one_line(code, err, *needles)
    assert not (tmp_path / "simulate.csv").exists()


def test_a_csv_trace_takes_rate_only_without_arrival_times(tmp_path, capsys):
    timed = tmp_path / "timed.csv"
    timed.write_text("arrival_time,prompt_len,output_len\n0.0,10,3\n0.5,12,2\n")
    code, _, err = run_cli(["simulate", "--trace", str(timed), "--rate", "9", "--out", str(tmp_path)], capsys)
    assert_one_line(code, err, "--rate", "arrival_time")
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("prompt_len,output_len\n10,3\n12,2\n")
    code, _, err = run_cli(["simulate", "--trace", str(lengths), "--rate", "9", "--policy", "fcfs",
                            "--out", str(tmp_path)], capsys)
    assert code == 0, err
    params = json.loads(_read_csv(tmp_path / "simulate.csv")[0]["params"])
    assert params["rate"] == 9.0


def test_results_record_only_settings_that_took_effect(tmp_path, capsys):
    code, out, err = run_cli(["simulate", "--trace", "azure_conv", "--num-requests", "20", "--policy", "fcfs",
                              "--out", str(tmp_path)], capsys)
    assert code == 0, err
    params = json.loads(_read_csv(tmp_path / "simulate.csv")[0]["params"])
    assert "rate" not in params and "seed" not in params and "model" not in params
    assert params["num_requests"] == 20 and params["trace"] == "azure_conv"
    assert "the first 20 of" in out and "--max-model-len" in out, "a shipped trace says what it used"


def test_load_trace_infers_the_format_like_the_cli(tmp_path):
    from servelab.scheduling.simulator import load_trace

    path = tmp_path / "x.csv"
    path.write_text("arrival_time,prompt_len,output_len\n0.0,10,3\n")
    trace = load_trace(path)
    assert trace.format == "csv" and len(trace) == 1
    with pytest.raises(ValueError, match="contradicts the shipped trace"):
        load_trace("azure_conv", "mooncake")


# ---- failures counted where the numbers are ----------------------------------------------------------


def _metrics(i: int, failed: bool):
    from servelab.scheduling.request import RequestMetrics

    if failed:
        return RequestMetrics(f"r{i}", "c", 0, "error", 40, 0, 0, 0, 0, 0, float(i), None, None, float(i) + 0.1, [])
    times = [i + 0.01, i + 0.02, i + 0.03]
    return RequestMetrics(f"r{i}", "c", 0, "length", 40, 3, 0, 0, 0, 0, float(i), float(i), times[0], times[-1],
                          times)


@pytest.mark.parametrize("num_failed", [0, 3, 5])
def test_every_latency_summary_counts_the_failed_requests(num_failed):
    import numpy as np

    from servelab.scheduling.simulator import SimulationResult

    requests = [_metrics(i, failed=i < num_failed) for i in range(5)]
    result = SimulationResult("fcfs", requests, num_steps=10, num_preemptions=0, kv_times=np.zeros(0),
                              kv_usage=np.zeros(0), wall_s=0.0)
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert result.latency(name).failed == num_failed, name
    assert result.latency("ttft").count == 5 - num_failed
    summary = result.summary()
    assert list(summary)[:3] == ["policy", "failed", "requests"]
    assert (summary["failed"], summary["requests"]) == (num_failed, 5)


# ---- exit codes agree; help; seeds -----------------------------------------------------------------


def test_blocks_failing_every_request_exits_2_like_simulate(tmp_path, capsys):
    code, _, err = run_cli(["blocks", "--num-blocks", "2", "--num-requests", "4", "--out", str(tmp_path)], capsys)
    assert_one_line(code, err, "all 4 requests failed", "--num-blocks")


def test_every_option_has_help_and_shows_its_default():
    import argparse

    from servelab.cli import _Parser, _add_blocks_parser, _add_demo_parser, _add_simulate_parser
    from servelab.cli.options import DefaultsHelpFormatter
    from servelab.cli.sweep import add_sweep_parser

    parser = _Parser(prog="servelab")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for add in (_add_demo_parser, _add_blocks_parser, _add_simulate_parser, add_sweep_parser):
        add(sub)
    for name, command in sub.choices.items():
        formatter = DefaultsHelpFormatter(prog=name)
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"
            shown = formatter._get_help_string(action)
            if action.default not in (None, False, argparse.SUPPRESS):
                assert "default" in shown, f"{name} {action.option_strings} does not show its default"


@pytest.mark.parametrize("command", ["demo", "blocks", "simulate"])
def test_a_negative_seed_names_the_option(capsys, command):
    code, _, err = run_cli([command, "--seed", "-1"], capsys)
    assert_one_line(code, err, "--seed", ">= 0")


def test_demo_with_a_billion_blocks_ends_fast_with_one_line(tmp_path):
    """The runaway: a pool far beyond the machine's memory is refused before anything is allocated."""
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a bounded budget, even if it regresses\n"
            "from servelab.cli import main\n"
            f"sys.exit(main(['demo', '--num-blocks', '1000000000', '--out', {str(tmp_path)!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "num_blocks" in proc.stderr or "--num-blocks" in proc.stderr


@pytest.mark.parametrize(("spec", "needles"), [
    ('[workload]\ntrace = "azure_conv"\nrate = 5.0\n[grid]\nreplicas = [1]\n', ["'rate'", "no effect"]),
    ('[workload]\nnum_requests = 5\nmax_tokens_cap = 8\n', ["'max_tokens_cap'", "trace only"]),
])
def test_sweep_keys_without_effect_are_refused(tmp_path, capsys, spec, needles):
    code, _, err = run_cli(["sweep", sweep_spec(tmp_path, spec), "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, *needles)


def test_sweep_accepts_max_model_len_without_a_trace():
    from servelab.cluster.sweep import expand_grid

    points = expand_grid({"workload": {"num_requests": 4}, "cluster": {"max_model_len": 4096}})
    assert points == [{"num_requests": 4, "max_model_len": 4096}], "a scheduler setting, not only a trace key"


def test_ctrl_c_during_simulate_keeps_the_finished_policies(tmp_path, capsys, monkeypatch):
    import servelab.scheduling.simulator as simulator

    real, calls = simulator.compare_policies, []

    def interrupted_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(simulator, "compare_policies", interrupted_on_the_second)
    code, _, err = run_cli(["simulate", "--num-requests", "6", "--policy", "fcfs,sjf", "--out", str(tmp_path)],
                           capsys)
    assert code == 130 and "interrupted after 1 of 2 policies" in err
    assert {r["implementation"] for r in _read_csv(tmp_path / "simulate.csv")} == {"fcfs"}


def test_requests_that_can_never_fit_are_counted_failed_not_dropped():
    """A request failed inside schedule() (it can never fit the pool) is in the results, counted failed."""
    from servelab.scheduling.simulator import LengthDist, WorkloadSpec, compare_policies

    workload = WorkloadSpec(num_requests=12, rate=100.0, prompt_len=LengthDist.parse("uniform:8:80"),
                            output_len=LengthDist.parse("fixed:4"), seed=3)
    result, = compare_policies(workload, ["fcfs"], num_blocks=4, block_size=16)
    assert len(result.requests) == 12, "every request is accounted for"
    assert 0 < result.num_failed < 12 and result.latency("ttft").failed == result.num_failed


# ---- sizes bounded by the machine before anything is built --------------------------------------------


@pytest.mark.parametrize(("argv", "needle"), [
    (["simulate", "--num-requests", "1000000000000"], "--num-requests 1000000000000"),
    (["simulate", "--num-blocks", "1000000000000"], "--num-blocks 1000000000000"),
    (["blocks", "--num-blocks", "1000000000000"], "--num-blocks 1000000000000"),
    (["demo", "--num-requests", "1000000000000"], "--num-requests 1000000000000"),
])
def test_sizes_beyond_the_machine_are_one_line_before_anything_is_built(tmp_path, capsys, argv, needle):
    start = time.perf_counter()
    code, out, err = run_cli(argv + ["--out", str(tmp_path)], capsys)
    assert_one_line(code, err, needle, "GiB is free")
    assert out == "" and time.perf_counter() - start < 5


def test_a_sweep_point_beyond_the_machine_is_refused_before_any_runs(tmp_path, capsys):
    spec = sweep_spec(tmp_path, "[workload]\nnum_requests = 5\n[cluster]\nnum_blocks = 1000000000000\n"
                                "[grid]\nreplicas = [1, 4]\n")
    code, _, err = run_cli(["sweep", spec, "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, "num_blocks 1000000000000")
    assert not (tmp_path / "o").exists()


def test_the_host_memory_estimate():
    from servelab.cli.bounds import check_host_memory, simulate_parts, typical_length

    assert typical_length("fixed:100") == 100 and typical_length("uniform:10:30") == 20
    assert 512 < typical_length("lognormal:512:0.6") < 700 and typical_length("bogus") == 0
    parts = simulate_parts(1000, "fixed:100", 4096, replicas=2)
    check_host_memory(parts, free=10 ** 9)  # ~5 MiB: fits
    with pytest.raises(ValueError, match=r"--num-blocks 4096 x 2 replicas needs"):
        check_host_memory(parts, free=1000)


def test_an_oserror_mid_run_is_one_line(tmp_path, capsys, monkeypatch):
    import servelab.cli.demo as demo

    def disk_full(result, path):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(demo, "plot_block_demo", disk_full)
    code, _, err = run_cli(["blocks", "--num-requests", "4", "--out", str(tmp_path)], capsys)
    assert_one_line(code, err, "No space left on device")


def test_a_sweep_where_every_request_fails_exits_2_like_the_other_commands(tmp_path, capsys):
    spec = sweep_spec(tmp_path, '[workload]\nnum_requests = 3\nprompt_len = "fixed:200"\noutput_len = "fixed:2"\n'
                                "[cluster]\nnum_blocks = 3\nblock_size = 16\n[grid]\nreplicas = [1]\n")
    code, _, err = run_cli(["sweep", spec, "--jobs", "1", "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, "all 3 requests of every point failed")
    assert len(_read_csv(tmp_path / "o" / "sweep.csv")) == 1, "the counted outcome is still written"


def test_the_real_ray_without_a_cluster_is_one_line(tmp_path, capsys, monkeypatch):
    """The documented `--address auto` with no cluster running, through the real Ray client library."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray instance is already initialised in this process")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray"))  # no session of another user's cluster is found
    code, _, err = run_cli(["sweep", sweep_spec(tmp_path), "--executor", "ray", "--address", "auto",
                            "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, "--address 'auto'", "no Ray cluster answers")


@pytest.mark.parametrize("argv", [
    ["simulate", "--policy", "nope", "--num-requests", "5"],
    ["simulate", "--trace", "azure_conv", "--rate", "3"],
    ["demo", "--model", "no-such-model-folder"],
    ["blocks", "--num-blocks", "1"],
])
def test_a_refused_run_leaves_no_output_folder(tmp_path, capsys, argv):
    out = tmp_path / "new" / "out"
    code, _, err = run_cli(argv + ["--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert not (tmp_path / "new").exists()


def test_a_missing_out_folder_is_created_by_the_run(tmp_path, capsys):
    out = tmp_path / "a" / "b"
    code, _, err = run_cli(["blocks", "--num-requests", "4", "--out", str(out)], capsys)
    assert code == 0, err
    assert (out / "block_demo.png").is_file()


def test_the_simulate_table_reads_failed_before_any_latency(tmp_path, capsys):
    code, out, err = run_cli(["simulate", "--num-requests", "6", "--policy", "fcfs", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.lstrip().startswith("policy"))
    assert header.split()[:2] == ["policy", "failed"]
