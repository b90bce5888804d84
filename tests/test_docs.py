"""The documentation works: every relative link resolves and every docs example runs.

- Every relative link in README.md and docs/*.md points at a file that exists
  and, with ``#anchor``, at a heading of that file (GitHub's anchor rule).
- Every ```python block of a docs/*.md page runs, in order, in one namespace
  per page, inside a temporary working directory; a block whose fence is
  preceded by the line ``<!-- not-executed -->`` is skipped (it needs a GPU,
  vLLM, a download ...). README.md's blocks are run by tests/test_readme_examples.py.
- README.md keeps the lines CI greps for, counts the notebooks that exist and
  stays an overview.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOT_EXECUTED = "<!-- not-executed -->"
_FENCE = re.compile(r"^(```|~~~)[^\n]*\n.*?^\1[ \t]*$", re.S | re.M)
_PYTHON = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced blocks and inline code (links there are not links)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped (but ``-`` and ``_``), spaces to ``-``."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = github_anchor(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[str]:
    found = []
    for match in _LINK.finditer(_prose(path.read_text(encoding="utf-8"))):
        target = match.group(1) or match.group(2)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked here
            found.append(target)
    return found


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target} (no file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading with anchor #{anchor} in {resolved.name})")
    assert not broken, f"{page.name}: broken links: {broken}"


def test_the_anchor_rule_matches_github():
    assert github_anchor("A. KV cache manager") == "a-kv-cache-manager"
    assert github_anchor("Run your piece in vLLM") == "run-your-piece-in-vllm"
    assert github_anchor("Beyond one replica: KV events, routers, P/D, sweeps") == \
        "beyond-one-replica-kv-events-routers-pd-sweeps"
    assert github_anchor("`servelab sweep` on Ray") == "servelab-sweep-on-ray"


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of each executed python block of ``page``."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for match in _PYTHON.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        if before != NOT_EXECUTED:
            blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1)))
    return blocks


PAGES_WITH_CODE = [p for p in sorted(DOCS.glob("*.md")) if python_blocks(p)]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.name)
def test_every_docs_example_runs(page, tmp_path, monkeypatch, one_torch_thread):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"__docs_{page.stem}__"}
    for line, code in python_blocks(page):
        exec(compile(code, f"docs/{page.name}:{line}", "exec"), namespace)


def test_the_not_executed_marker_skips_only_its_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- not-executed -->\n```python\nraise SystemExit\n```\n\n```python\nx = 1\n```\n")
    assert python_blocks(page) == [(8, "x = 1\n")]


def test_readme_keeps_ci_lines_counts_notebooks_and_stays_short():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for line in ('pip install -e ".[dev]" && servelab demo', "python -m pytest"):
        assert line in readme, f"README must keep {line!r} verbatim (CI greps for it)"
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    stated = re.search(r"\*\*Notebooks\*\* \((\d+),", readme)
    assert stated and int(stated.group(1)) == len(notebooks), f"README counts {stated and stated.group(1)} notebooks"
    missing = [n for n in notebooks if f"notebooks/{n}" not in readme]
    assert not missing, f"README does not link notebooks {missing}"
    assert readme.count("\n") <= 450, "README is an overview: move long sections to docs/<piece>.md"
    install = readme.index("pip install torch")
    assert install < readme.index('pip install -e ".[dev]"'), "the CPU-torch step comes first in the quick start"
