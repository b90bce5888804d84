import pytest

from servelab.cli import main
from servelab.cli.demo import run_block_demo


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
    with pytest.raises(SystemExit) as info:
        main(["blocks", "--num-blocks", "-3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "a positive integer" in err and err.count("\n") == 1
    assert main([]) == 0
    assert "servelab demo --model PATH" in capsys.readouterr().out


# ---- user mistakes: exit code 2 and one line on stderr, never a traceback ------------------------


def run_cli(argv, capsys):
    """``main(argv)``'s exit code (argparse errors exit through SystemExit) and stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def assert_one_line_error(code, err, *needles):
    assert code == 2, f"exit code {code}, stderr {err!r}"
    assert err.count("\n") == 1 and err.endswith("\n"), f"not one line: {err!r}"
    assert "Traceback" not in err and "error" in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("name", "argv", "needles"), [
    ("threads", ["demo", "--threads", "-1"], ["--threads", ">= 0"]),
    ("blocks-1", ["blocks", "--num-blocks", "1"], ["--num-blocks 1", ">= 2"]),
    ("policy-empty", ["simulate", "--policy", "", "--num-requests", "5"], ["--policy", "valid:"]),
    ("policy-unknown", ["simulate", "--policy", "fcfs,nope", "--num-requests", "5"], ["nope", "valid:"]),
    ("rate-0", ["simulate", "--rate", "0", "--num-requests", "5"], ["--rate", "> 0"]),
    ("prompt-too-long", ["simulate", "--prompt-len", "10000", "--max-model-len", "512", "--num-requests", "20"],
     ["--max-model-len 512"]),
    ("cost-model", ["simulate", "--cost-model", "1,2", "--num-requests", "5"], ["--cost-model"]),
    ("engine", ["simulate", "--engine", "tgi"], ["--engine"]),
    ("kv-too-small", ["simulate", "--num-blocks", "3", "--num-requests", "10", "--policy", "fcfs"],
     ["every request failed", "--num-blocks"]),
])
def test_cli_user_mistakes_exit_2_with_one_line(tmp_path, capsys, name, argv, needles):
    code, err = run_cli(argv + ["--out", str(tmp_path)], capsys)
    assert_one_line_error(code, err, *needles)


@pytest.mark.parametrize(("rows", "needles"), [
    ("arrival_time,prompt_len,output_len\n0.1,10,3\nnan,12,2\n", ["line 3", "arrival_time", "nan"]),
    ("arrival_time,prompt_len,output_len\n0.1,10,3\n-1,12,2\n", ["line 3", "arrival_time"]),
    ("arrival_time,prompt_len,output_len\n0.1,10,3\n0.2,12\n", ["line 3", "output_len"]),
    ("arrival_time,prompt_len,output_len\n0.1,10,3,9\n", ["line 2", "cells"]),
    ("arrival_time,prompt_len\n0.1,10\n", ["output_len"]),
    ("arrival_time,prompt_len,output_len\n0.1,ten,3\n", ["line 2", "prompt_len", "ten"]),
])
def test_cli_bad_traces_exit_2_naming_the_row_and_column(tmp_path, capsys, rows, needles):
    trace = write(tmp_path / "trace.csv", rows)
    code, err = run_cli(["simulate", "--trace", trace, "--out", str(tmp_path)], capsys)
    assert_one_line_error(code, err, *needles)


def test_cli_trace_without_arrivals_and_rate_0(tmp_path, capsys):
    trace = write(tmp_path / "lengths.csv", "prompt_len,output_len\n10,3\n12,2\n")
    code, err = run_cli(["simulate", "--trace", trace, "--rate", "0", "--out", str(tmp_path)], capsys)
    assert_one_line_error(code, err, "--rate")
    code, err = run_cli(["simulate", "--trace", trace, "--rate", "inf", "--policy", "fcfs", "--out", str(tmp_path)],
                        capsys)
    assert code == 0 and err == ""


def test_cli_demo_on_a_truncated_checkpoint_exits_2(tmp_path, capsys):
    from servelab.cli.demo import default_demo_model

    model = default_demo_model(tmp_path)
    weights = next(model.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    code, err = run_cli(["demo", "--model", str(model), "--num-requests", "2", "--max-tokens", "2",
                         "--out", str(tmp_path)], capsys)
    assert_one_line_error(code, err)


def test_cli_demo_with_a_pool_too_small_reports_every_reason_and_no_throughput(tmp_path, capsys):
    code = main(["demo", "--num-blocks", "3", "--num-requests", "4", "--max-tokens", "4", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert_one_line_error(code, captured.err, "all 4 requests failed", "cannot fit in the KV cache")
    reasons = [line for line in captured.out.splitlines() if "cannot fit in the KV cache" in line]
    assert len(reasons) >= 4, "every failed request's reason is printed"
    assert "0.0 tok/s (0.00 req/s)" in captured.out, "failures are not throughput"
