import pytest

from servelab.cli import main
from servelab.demo import run_block_demo


def test_block_demo_serves_everything_without_leaks():
    result = run_block_demo(num_requests=24, num_blocks=40, block_size=8, token_budget=96, seed=1)
    assert result.finished + result.failed == 24
    assert result.finished > 0
    assert result.leaked_blocks == 0
    assert result.preemptions > 0, "the workload is sized to force preemption"
    assert 0 < result.hit_rate < 1, "shared system prompts must give prefix hits"
    assert result.evictions > 0


def test_block_demo_fails_requests_that_cannot_fit_instead_of_spinning():
    result = run_block_demo(num_requests=5, num_blocks=3, block_size=16, token_budget=64)
    assert result.failed == 5 and result.finished == 0 and result.leaked_blocks == 0


def test_cli_blocks_prints_a_table_and_saves_a_figure(tmp_path, capsys):
    assert main(["blocks", "--num-requests", "8", "--num-blocks", "48", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "prefix-cache hit rate" in out
    assert out.splitlines()[-3].split()[-1] == "0", "the leak row must read 0"
    assert (tmp_path / "block_demo.png").stat().st_size > 1000


def test_cli_demo_runs_the_pipeline_on_the_tiny_model(tmp_path, capsys):
    assert main(["demo", "--num-requests", "12", "--max-tokens", "8", "--num-blocks", "24",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for row in ("throughput", "TTFT", "ITL", "prefix-cache hit rate", "acceptance rate", "preemptions"):
        assert row in out
    assert (tmp_path / "tiny-llama" / "config.json").is_file()
    assert (tmp_path / "pipeline_report.png").stat().st_size > 1000


def test_cli_demo_refuses_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    assert main(["demo", "--model", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_cli_rejects_bad_arguments_and_prints_help(capsys):
    with pytest.raises(SystemExit):
        main(["blocks", "--num-blocks", "-3"])
    assert "must be a positive integer" in capsys.readouterr().err
    assert main([]) == 0
    assert "servelab demo --model PATH" in capsys.readouterr().out
