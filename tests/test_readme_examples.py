"""Every Python example in README.md runs, as written.

The README's "how to swap it" column points at short examples; they are
documentation only if they work, so each ```python block is executed here in
a fresh namespace inside a temporary working directory (unless the line before its fence is
``<!-- not-executed -->``; the long forms live in docs/*.md, run by tests/test_docs.py). The
"Run your piece in vLLM" recipe
needs vLLM and a model; it is executed by
``tests/integrations/test_vllm_readme_snippet.py`` in the vLLM environment
(with a stand-in ``LLM``), so it is skipped here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    text = README.read_text(encoding="utf-8")
    blocks = []
    for match in _BLOCK.finditer(text):
        if text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip() == "<!-- not-executed -->":
            continue  # the same marker as docs/*.md (tests/test_docs.py)
        line = text.count("\n", 0, match.start()) + 1
        blocks.append((f"README.md:{line}", match.group(1)))
    return blocks


def test_readme_has_examples():
    assert len(_blocks()) >= 6


@pytest.mark.parametrize("where, code", _blocks(), ids=[w for w, _ in _blocks()])
def test_readme_example_runs(where, code, tmp_path, monkeypatch, one_torch_thread):
    if "servelab.integrations.vllm" in code:
        pytest.skip(f"{where} is run by tests/integrations/test_vllm_readme_snippet.py in the vLLM environment")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__readme__"})
