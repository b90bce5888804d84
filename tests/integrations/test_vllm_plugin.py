"""servelab's ``vllm.general_plugins`` entry point is inert until the user opts in.

vLLM's own loader (``vllm.plugins.load_general_plugins``) runs in a fresh process that sees
servelab's entry point exactly as pyproject.toml declares it (a dist-info written from it shadows
the installed one): without ``SERVELAB_VLLM_ATTENTION=1`` the environment is unchanged, the CUSTOM
attention slot stays free and nothing raises; with it, the backend is registered. Skipped without vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
import warnings
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import json, os, sys, warnings
    import vllm.plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    before = dict(os.environ)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vllm.plugins.load_general_plugins()
    after = dict(os.environ)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    slot = AttentionBackendEnum.CUSTOM.get_path() if AttentionBackendEnum.CUSTOM.is_overridden() else None
    print(json.dumps({"changed": changed, "slot": slot, "warnings": [str(w.message) for w in caught if "servelab" in str(w.message)]}))
""")


def declared_entry_point() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (name, value), = project["entry-points"]["vllm.general_plugins"].items()
    return f"{name} = {value}"


def run_loader(tmp_path: Path, **env: str) -> dict:
    dist = tmp_path / "servelab-0.1.0.dist-info"  # shadows the installed servelab's (possibly stale) metadata
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: servelab\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{declared_entry_point()}\n")
    child_env = {k: v for k, v in os.environ.items()
                 if k not in ("VLLM_TARGET_DEVICE", "SERVELAB_VLLM_ATTENTION", "VLLM_PLUGINS")}
    child_env.update(env, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", PROBE], env=child_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_plugin_does_nothing_without_opt_in(tmp_path):
    result = run_loader(tmp_path)
    assert result == {"changed": [], "slot": None, "warnings": []}


def test_the_plugin_registers_the_backend_with_opt_in(tmp_path):
    result = run_loader(tmp_path, SERVELAB_VLLM_ATTENTION="1")
    assert result["slot"] == "servelab.integrations.vllm.attention.ServelabAttentionBackend"
    # importing vLLM's own Triton backend module may set vLLM's flags; servelab sets none
    assert "VLLM_TARGET_DEVICE" not in result["changed"] and result["warnings"] == []


def test_an_unsupported_vllm_version_is_one_warning_not_an_exception(monkeypatch):
    import importlib.metadata

    from servelab.integrations import vllm_plugin
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if AttentionBackendEnum.CUSTOM.is_overridden():
        pytest.skip("another test of this process registered the CUSTOM backend already")
    monkeypatch.setenv("SERVELAB_VLLM_ATTENTION", "1")
    monkeypatch.delenv("SERVELAB_VLLM_ALLOW_UNSUPPORTED", raising=False)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.99.0")
    monkeypatch.setattr(vllm_plugin, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert vllm_plugin.load() is None
        assert vllm_plugin.load() is None
    messages = [str(w.message) for w in caught if "servelab" in str(w.message)]
    assert len(messages) == 1 and "0.99.0" in messages[0]
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
