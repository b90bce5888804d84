"""The package layout is part of the contract.

- No module outside ``servelab/reference/`` imports ``servelab.reference``
  (the references are the spec, never the fast path; registries may name them
  lazily as ``"servelab.reference...:attr"`` strings, which are not imports).
- ``servelab/``'s top level holds only ``__init__``, ``config``, ``results`` and packages.
- No import cycle inside ``servelab/``: every ``import`` counts, function-local
  and ``TYPE_CHECKING`` ones included (a local import must not hide a cycle).
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
    assert modules == ["__init__.py", "config.py", "results.py"]
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


# ---- import cycles ------------------------------------------------------------------------------

# Cycles tolerated for now (none: load_config moved to models/loader.py, so models/config.py no
# longer reaches models/gguf.py). Add an entry only with a comment saying how to remove it.
KNOWN_CYCLES: set[frozenset[str]] = set()


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source (relative imports
    resolved; ``from pkg import submodule`` is an edge to the submodule, otherwise to ``pkg``)."""
    root = package.parent
    modules = {_module_name(p, root): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(component)
    return cycles


def test_no_import_cycle_inside_servelab():
    graph = import_graph(PACKAGE)
    new = [sorted(c) for c in import_cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    assert new == [], "import cycles (function-local and TYPE_CHECKING imports count): " + "; ".join(
        " <-> ".join(c) for c in new)


def test_the_cycle_scan_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert import_cycles(import_graph(pkg)) == [{"pkg.a", "pkg.sub.b"}]
