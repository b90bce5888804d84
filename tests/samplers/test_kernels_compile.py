"""The sampling kernels compile for a CUDA target, on a machine without a GPU.

The interpreter accepts code the compiler refuses (non-constexpr globals,
mismatched types across branches...), so the GPU path is checked by running
Triton's real compiler down to a cubin for sm_90, in a subprocess with the
interpreter off. The PTX must divide with IEEE ``div.rn`` (as torch does), so
the race scores, hence the tokens, match the reference on a GPU.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import importlib, itertools, json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sampling = importlib.import_module("servelab.kernels.sampling")
    rejection = importlib.import_module("servelab.kernels.rejection_sample")
    target = GPUTarget("cuda", 90, 32)
    report = {}

    def build(name, fn, signature, constexprs):
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target)
        ptx = kernel.asm["ptx"]
        report[name] = {"cubin": len(kernel.asm["cubin"]) > 0, "div_full": ptx.count("div.full"),
                        "div_rn": ptx.count("div.rn")}

    signature = {"logits_ptr": "*fp32", "logits_row_stride": "i64", "noise_ptr": "*fp32",
                 "noise_row_stride": "i64", "top_k_ptr": "*i32", "top_p_ptr": "*fp32", "min_p_ptr": "*fp32",
                 "out_ptr": "*i64", "vocab_size": "i32", "USE_TOP_K": "constexpr", "USE_TOP_P": "constexpr",
                 "USE_MIN_P": "constexpr", "BLOCK": "constexpr", "PROBES": "constexpr",
                 "ACCURATE_EXP": "constexpr"}
    for dtype, flags in itertools.product(("fp32", "bf16", "fp16"), ((True, True, True), (False, True, False))):
        build(f"sample-{dtype}-{flags}", sampling._top_k_top_p_sample_kernel,
              dict(signature, logits_ptr="*" + dtype),
              {"USE_TOP_K": flags[0], "USE_TOP_P": flags[1], "USE_MIN_P": flags[2], "BLOCK": 1024,
               "PROBES": 16, "ACCURATE_EXP": True})
    signature = {"out_ptr": "*i64", "out_row_stride": "i64", "draft_ids_ptr": "*i64", "draft_offsets_ptr": "*i64",
                 "target_ptr": "*fp32", "target_row_stride": "i64", "draft_probs_ptr": "*fp32",
                 "draft_row_stride": "i64", "greedy_ptr": "*i8", "uniform_ptr": "*fp32", "noise_ptr": "*fp32",
                 "noise_row_stride": "i64", "vocab_size": "i32", "HAS_DRAFT_PROBS": "constexpr",
                 "BLOCK": "constexpr"}
    for has_draft_probs in (True, False):
        build(f"rejection-{has_draft_probs}", rejection._rejection_sample_kernel, signature,
              {"HAS_DRAFT_PROBS": has_draft_probs, "BLOCK": 1024})
    print("REPORT" + json.dumps(report))
    """
)


def test_kernels_compile_to_cubin_for_sm90(tmp_path):
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report_line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT"))
    report = json.loads(report_line[len("REPORT"):])
    assert len(report) == 8
    for name, entry in report.items():
        assert entry["cubin"], name
        assert entry["div_full"] == 0 and entry["div_rn"] > 0, (name, entry)
