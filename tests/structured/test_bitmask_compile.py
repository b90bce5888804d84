"""The bitmask kernel compiles for a CUDA target (sm_90) on a machine without a GPU.

The interpreter accepts code the compiler refuses, so the GPU path is checked
by running Triton's real compiler down to a cubin, in a subprocess with the
interpreter off, for every logits dtype the kernel takes.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import importlib, json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bitmask = importlib.import_module("servelab.kernels.bitmask")
    report = {}
    for dtype in ("fp32", "fp16", "bf16"):
        signature = {"logits_ptr": "*" + dtype, "bitmask_ptr": "*i32", "indices_ptr": "*i64", "vocab_size": "i32",
                     "stride_lt": "i64", "stride_lv": "i64", "stride_bt": "i64", "BLOCK": "constexpr"}
        kernel = triton.compile(ASTSource(fn=bitmask._apply_token_bitmask_kernel, signature=signature,
                                          constexprs={"BLOCK": 1024}), target=GPUTarget("cuda", 90, 32))
        report[dtype] = len(kernel.asm["cubin"]) > 0
    print("REPORT" + json.dumps(report))
    """
)


def test_bitmask_kernel_compiles_to_cubin_for_sm90(tmp_path):
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("REPORT"))[6:])
    assert report == {"fp32": True, "fp16": True, "bf16": True}
