"""bench/gpu/vllm_integration.py --cpu-smoke: the GPU script's imports and wiring, without a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_script_cpu_smoke():
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "bench/gpu/vllm_integration.py"), "--cpu-smoke"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ServelabAttentionBackend" in proc.stdout and "cpu smoke: OK" in proc.stdout
