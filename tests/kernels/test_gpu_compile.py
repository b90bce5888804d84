"""The kernels must also compile for a GPU, which the interpreter cannot tell us.

Runs ``gpu_compile_check.py`` (Triton's offline compiler, sm_90 target) in a
subprocess with ``TRITON_INTERPRET=0`` over the launch configurations the
host code picks. This caught, for instance, a non-constexpr global that the
interpreter happily read.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("gpu_compile_check.py")
SHARED_MEMORY_BUDGET = 99 * 1024  # fits consumer GPUs too (sm_86/89: 99 KB per block)


@pytest.mark.parametrize("arch", [90])
def test_kernels_compile_for_gpu(arch):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", str(arch)], capture_output=True, text=True, timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "0"},
    )
    results = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    assert results, f"no results; stderr:\n{completed.stderr[-3000:]}"
    failures = [f"{r['name']}: {r['error']}" for r in results if not r["ok"]]
    assert not failures, "\n\n".join(failures)
    assert completed.returncode == 0, completed.stderr[-3000:]
    names = " ".join(r["name"] for r in results)
    for kernel in ("attention:", "combine splits:", "reshape_and_cache", "reshape_and_cache quantized",
                   "merge_attn_states", "lora bgmv", "lora sgmv",
                   "fused_moe gate/up", "fused_moe down"):
        assert kernel in names
    too_big = [f"{r['name']}: {r['shared']} B" for r in results if r["shared"] > SHARED_MEMORY_BUDGET]
    assert not too_big, too_big
