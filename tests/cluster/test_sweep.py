"""Sweeps: grid expansion, the local executor, the CLI, and the same task on a local Ray instance."""

from __future__ import annotations

import csv

import pytest

from servelab.cli import main
from servelab.cluster.sweep import expand_grid, run_point, run_sweep, sweep_rows

SPEC = """
[workload]
num_requests = 40
rate = 30.0
prompt_len = "uniform:16:64"
output_len = "uniform:1:8"
num_prefix_groups = 4
prefix_len = 64

[cluster]
num_blocks = 256

[grid]
router = ["round_robin", "prefix_affinity"]
replicas = [1, 2]
"""


def test_grid_expands_every_combination():
    points = expand_grid({"workload": {"rate": 1.0}, "grid": {"router": ["a", "b"], "seed": [0, 1, 2]}})
    assert len(points) == 6 and points[0] == {"rate": 1.0, "router": "a", "seed": 0}
    with pytest.raises(ValueError, match="unknown"):
        expand_grid({"grid": {"routr": ["a"]}})
    with pytest.raises(ValueError, match="non-empty list"):
        expand_grid({"grid": {"router": "a"}})


def test_run_point_with_pd_and_rows():
    row = run_point({"num_requests": 20, "rate": 20.0, "prompt_len": "fixed:48", "output_len": "fixed:4",
                     "prefill_replicas": 1, "decode_replicas": 1, "kv_bandwidth_gbps": 50.0, "num_blocks": 128})
    assert row["pd_prefill"] == 1 and row["requests"] == 20
    rows = sweep_rows([row], "t")
    assert {r["metric"] for r in rows} >= {"ttft_p90", "prefix_hit_rate", "imbalance"}
    assert all(r["component"] == "cluster" for r in rows)


def test_local_executor_in_process_and_bad_executor():
    points = expand_grid({"workload": {"num_requests": 10, "prompt_len": "fixed:32", "output_len": "fixed:2"},
                          "grid": {"replicas": [1, 2]}})
    assert [r["replicas"] for r in run_sweep(points, jobs=1)] == [1, 2]
    with pytest.raises(ValueError, match="executor"):
        run_sweep(points, "dask")


def test_cli_sweep_local(tmp_path, capsys):
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    assert main(["sweep", str(spec), "--jobs", "2", "--out", str(tmp_path / "out")]) == 0
    with open(tmp_path / "out" / "sweep.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    with open(tmp_path / "out" / "results.csv") as f:
        assert {r["implementation"] for r in csv.DictReader(f)} == {"round_robin", "prefix_affinity"}
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 0


@pytest.mark.parametrize("text, message", [("[grid]\nrouter = ['nope']\n", "unknown router"),
                                           ("[grid\n", "not valid TOML"), ("[gird]\n", "unknown sections")])
def test_cli_sweep_user_mistakes_are_one_line(tmp_path, capsys, text, message):
    spec = tmp_path / "bad.toml"
    spec.write_text(text)
    assert main(["sweep", str(spec), "--jobs", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_ray_sweep_runs_the_same_task(tmp_path):
    ray = pytest.importorskip("ray")
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert main(["sweep", str(spec), "--executor", "ray", "--out", str(tmp_path / "ray")]) == 0
    finally:
        ray.shutdown()
    local = run_sweep(expand_grid(__import__("servelab.cluster.sweep", fromlist=["load_spec"]).load_spec(spec)),
                      jobs=1)
    with open(tmp_path / "ray" / "sweep.csv") as f:
        on_ray = list(csv.DictReader(f))
    assert [float(r["ttft_p90"]) for r in on_ray] == pytest.approx([r["ttft_p90"] for r in local])
