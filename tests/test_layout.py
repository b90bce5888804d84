"""The package layout is part of the contract.

- No module outside ``servelab/reference/`` imports ``servelab.reference``
  (the references are the spec, never the fast path; registries may name them
  lazily as ``"servelab.reference...:attr"`` strings, which are not imports).
- ``servelab/``'s top level holds only ``__init__``, ``config`` and packages.
- Running the fast path (the pipeline with its default pieces: SDPA
  attention, the block pool, greedy sampling, n-gram speculation with the
  rejection verifier) loads no reference module. (Random sampling on a CPU
  goes through the ``"torch"`` sampling backend, which *is* the reference
  top-k/top-p sampler, loaded through the registry by design, as the
  ``"torch"`` attention backend is.)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "servelab"


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_no_fast_path_module_imports_the_references():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "reference" in path.relative_to(PACKAGE).parts[:1]:
            continue
        bad = [n for n in _imports(path) if n == "servelab.reference" or n.startswith("servelab.reference.")]
        offenders += [f"{path.relative_to(PACKAGE.parent)}: {n}" for n in bad]
    assert offenders == []


def test_the_import_scan_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from servelab.reference import paged_attention\n")
    assert "servelab.reference" in _imports(bad)


def test_top_level_holds_only_init_config_and_packages():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert modules == ["__init__.py", "config.py"]
    assert (PACKAGE / "cli" / "__init__.py").is_file()


def test_running_the_pipeline_loads_no_reference_module(tmp_path):
    code = (
        "import sys, torch; torch.set_num_threads(1)\n"
        "from servelab import Pipeline, SamplingParams\n"
        "from servelab.models import build_tiny_model\n"
        f"pipe = Pipeline.from_pretrained(build_tiny_model({str(tmp_path / 'tiny')!r}), drafter='ngram',"
        " num_speculative_tokens=2)\n"
        "pipe.generate(['The cache'], SamplingParams(temperature=0, max_tokens=6))\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('servelab.reference'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
