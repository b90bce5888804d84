"""bench/results_io.py and bench/plot.py on a temporary results file."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str, module_name: str):
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


results_io = _load("results_io", "results_io")  # plot.py imports it under this name
plot = _load("plot", "servelab_bench_plot")


def _rows():
    rows = []
    for impl, scale in (("fast", 1.0), ("reference", 3.0)):
        for n in (1, 16):
            rows.append(results_io.make_row("blocks", impl, "alloc_free", "us", scale * n, params={"n": n},
                                            p20=scale * n * 0.9, p50=scale * n, p80=scale * n * 1.2))
    rows.append(results_io.make_row("blocks", "fast", "prefix_hit", "us", 7.0))
    rows.append(results_io.make_row("sampler", "torch", "forward", "us", 50.0, params={"vocab": "32k"}))
    return rows


def test_append_creates_file_with_header_and_round_trips(tmp_path):
    path = tmp_path / "sub" / "results.csv"
    assert results_io.append_rows(_rows()[:3], path) == path
    results_io.append_rows(_rows()[3:], path)
    with path.open(newline="") as fh:
        assert tuple(next(csv.reader(fh))) == results_io.COLUMNS
    rows = results_io.read_rows(path)
    assert len(rows) == 6
    assert rows[0]["params"] == {"n": 1} and rows[0]["value"] == 1.0 and rows[0]["p80"] == pytest.approx(1.2)
    assert rows[4]["p20"] is None and rows[4]["params"] == {}
    assert "python" in rows[0]["versions"] and "torch" in rows[0]["versions"]
    assert rows[0]["git_sha"]
    assert [r["implementation"] for r in results_io.read_rows(path, component="sampler")] == ["torch"]


def test_bad_rows_append_nothing(tmp_path):
    path = tmp_path / "results.csv"
    with pytest.raises(ValueError, match="value"):
        results_io.make_row("blocks", "fast", "m", "us", float("nan"))
    with pytest.raises(ValueError, match="component"):
        results_io.make_row("", "fast", "m", "us", 1.0)
    with pytest.raises(ValueError, match="params"):
        results_io.make_row("blocks", "fast", "m", "us", 1.0, params={"x": object()})
    good = _rows()[0]
    with pytest.raises(ValueError, match="unknown columns"):
        results_io.append_rows([good, dict(good, bogus=1)], path)
    assert not path.exists()
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="header"):
        results_io.append_rows([good], path)


def test_env_switch_and_percentiles(tmp_path, monkeypatch):
    monkeypatch.setenv(results_io.ENV_PATH, "0")
    assert results_io.append_rows(_rows()) is None
    monkeypatch.setenv(results_io.ENV_PATH, str(tmp_path / "r.csv"))
    assert results_io.append_rows(_rows()) == tmp_path / "r.csv"
    q = results_io.percentiles([5, 1, 2, 3, 4])
    assert q == {"p20": pytest.approx(1.8), "p50": 3.0, "p80": pytest.approx(4.2)}
    assert results_io.percentiles([2.0]) == {"p20": 2.0, "p50": 2.0, "p80": 2.0}


def test_plot_and_markdown(tmp_path, capsys):
    path = tmp_path / "results.csv"
    rows = _rows()
    results_io.append_rows(rows, path)
    results_io.append_rows([dict(rows[0], value=2.0)], path)  # a re-run: the latest row wins
    out = tmp_path / "blocks.png"
    assert plot.main(["--csv", str(path), "--component", "blocks", "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    cat = tmp_path / "sampler.png"
    assert plot.main(["--csv", str(path), "--component", "sampler", "--param", "vocab", "--out", str(cat)]) == 0
    assert cat.exists()
    with pytest.raises(SystemExit):
        plot.main(["--csv", str(path), "--component", "nope", "--out", str(tmp_path / "x.png")])
    capsys.readouterr()
    assert plot.main(["--csv", str(path), "--markdown", "--component", "blocks"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| component | implementation | metric")
    assert len(table) == 2 + 5  # four alloc_free rows + prefix_hit, the re-run replacing its older row
    assert any("| fast | alloc_free | n=1 | 2 |" in line for line in table)
    assert "| 1 |" not in " ".join(table)
    assert len(plot.markdown_table(results_io.read_rows(path), all_rows=True).splitlines()) == 2 + 7
