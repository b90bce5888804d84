"""Compile the Triton kernels for a GPU without a GPU (Triton's offline compiler + bundled ptxas).

The interpreter executes kernels as Python, so it accepts code the GPU
compiler rejects (a non-constexpr global, a constexpr reassigned in a loop,
too much shared memory...). This script compiles the launch configurations
the host code actually picks (via ``plan_launch``) for ``--arch`` and prints
one JSON line per kernel: ``{"name", "ok", "shared", "error"}``.

    TRITON_INTERPRET=0 python tests/kernels/gpu_compile_check.py --arch 90
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # need real JITFunctions, not interpreted ones

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import servelab.kernels  # noqa: E402,F401  (registers the submodules)

attention = sys.modules["servelab.kernels.paged_attention"]
cache_write = sys.modules["servelab.kernels.reshape_and_cache"]
merge = sys.modules["servelab.kernels.merge_attn_states"]

TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Unit strides arrive as constexpr 1 (Triton specialises integer arguments equal to 1).
UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_bt_col", "stride_pd",
                "stride_kcd", "stride_vcd", "stride_ad", "stride_bd")


def compile_kernel(kernel, pointer_types, scalar_types, constants, target, num_warps, num_stages=2,
                   return_compiled=False):
    constants = dict(constants)
    for name in kernel.arg_names:
        if name in UNIT_STRIDES:
            constants[name] = 1
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = "*" + pointer_types[name]
        else:
            signature[name] = scalar_types.get(name, "i32")
    # As a real launch would: pointers 16-byte aligned and (for serving shapes
    # such as head 128) strides divisible by 16; this is what lets Triton
    # vectorise loads, so the compiled code matches what runs.
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if signature[name].startswith("*") or (name.startswith("stride") and name not in constants)}
    compiled = triton.compile(ASTSource(kernel, signature, constants, aligned), target=target,
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    return compiled if return_compiled else compiled.metadata.shared


def attention_cases():
    base = dict(num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16,
                causal=True, sliding_window=None, softcap=None, return_lse=False, num_splits=None)
    yield "decode bf16 h128 b64 ctx4096", dict(base, num_tokens=64, num_seqs=64, max_context=4096), {}
    yield "decode bf16 one seq (num_seqs=1) split", dict(base, num_tokens=1, num_seqs=1, max_context=32768), {"num_seqs": 1}
    yield "prefill bf16 h128 window softcap lse", dict(base, num_tokens=4096, num_seqs=1, max_context=4096,
                                                       sliding_window=1024, softcap=30.0, return_lse=True), {}
    yield "prefill fp16 h80 non-causal", dict(base, num_tokens=2048, num_seqs=4, max_context=2048, head_size=80,
                                              dtype=torch.float16, causal=False), {}
    yield "prefill fp32 h256 (ieee dots)", dict(base, num_tokens=512, num_seqs=2, max_context=1024, head_size=256,
                                                dtype=torch.float32), {}
    yield "decode bf16 MQA group 32 h256", dict(base, num_tokens=8, num_seqs=8, max_context=8192, num_kv_heads=1,
                                                head_size=256), {}
    yield "tree verify bf16 h64 (token-tree mask)", dict(base, num_tokens=8 * 33, num_seqs=8, max_context=4096,
                                                          head_size=64, tree=True), {}
    yield "decode bf16 int8 pages (kv_quant)", dict(base, num_tokens=64, num_seqs=64, max_context=4096,
                                                    kv_format=1), {}
    yield "decode bf16 fp8 e4m3 pages (kv_quant)", dict(base, num_tokens=64, num_seqs=64, max_context=4096,
                                                        kv_format=2), {}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    results = []

    def attempt(name, fn):
        try:
            results.append(dict(name=name, ok=True, shared=fn(), error=None))
        except Exception as error:  # report every kernel, not just the first failure
            results.append(dict(name=name, ok=False, shared=None, error=f"{type(error).__name__}: {error}"[:3000]))

    for name, shape, specialised in attention_cases():
        plan = attention.plan_launch(**shape, interpreted=False, num_sms=132)
        element = TRITON_TYPES[shape["dtype"]]
        page = {0: element, 1: "i8", 2: "u8", 3: "u8"}[shape.get("kv_format", 0)]  # fp8 pages travel as bytes
        pointers = dict(q_ptr=element, k_cache_ptr=page, v_cache_ptr=page, k_scale_ptr="fp32", v_scale_ptr="fp32",
                        out_ptr="fp32" if plan.num_splits > 1 else element, lse_ptr="fp32",
                        block_table_ptr="i32", seq_lens_ptr="i32", query_start_loc_ptr="i32",
                        tree_ancestors_ptr="i64", tree_lens_ptr="i32")
        scalars = dict(scale="fp32", softcap="fp32")
        constants = dict(plan.attention_constants, **specialised)
        attempt(f"attention: {name} {plan.tiles} splits={plan.num_splits}", lambda: compile_kernel(
            attention._paged_attention_kernel, pointers, scalars, constants, target,
            plan.tiles.num_warps, plan.tiles.num_stages))
        if plan.combine_grid is not None:
            attempt(f"combine splits: {name}", lambda: compile_kernel(
                attention._combine_splits_kernel,
                dict(partial_out_ptr="fp32", partial_lse_ptr="fp32", out_ptr=element, lse_ptr="fp32"),
                {}, plan.combine_constants, target, num_warps=4))
    for slot_type in ("i32", "i64"):
        attempt(f"reshape_and_cache bf16 slots {slot_type}", lambda: compile_kernel(
            cache_write._reshape_and_cache_kernel,
            dict(key_ptr="bf16", value_ptr="bf16", key_cache_ptr="bf16", value_cache_ptr="bf16",
                 slot_mapping_ptr=slot_type), {},
            dict(HEAD_SIZE=128, HEADS_PAD=8, HEAD_PAD=128, PAGE_SIZE=16), target, num_warps=4))
    for kv_format, page, static in ((1, "i8", False), (2, "u8", False), (3, "u8", True)):  # fp8 pages as bytes
        attempt(f"reshape_and_cache quantized bf16 -> format {kv_format} static={static}", lambda: compile_kernel(
            cache_write._quantized_write_kernel,
            dict(key_ptr="bf16", value_ptr="bf16", key_cache_ptr=page, value_cache_ptr=page, k_scale_ptr="fp32",
                 v_scale_ptr="fp32", slot_mapping_ptr="i64"), dict(max_value="fp32"),
            dict(HEAD_SIZE=128, HEADS_PAD=8, HEAD_PAD=128, PAGE_SIZE=16, STATIC_K=static, STATIC_V=static,
                 KV_FORMAT=kv_format), target, num_warps=4))
    attempt("merge_attn_states bf16", lambda: compile_kernel(
        merge._merge_attn_states_kernel,
        dict(out_a_ptr="bf16", lse_a_ptr="fp32", out_b_ptr="bf16", lse_b_ptr="fp32", out_ptr="bf16",
             lse_ptr="fp32"), {}, dict(HEAD_SIZE=128, HEAD_PAD=128, BLOCK_H=16), target, num_warps=4))
    lora = importlib.import_module("servelab.kernels.lora")
    lora_pointers = dict(x_ptr="bf16", w_ptr="bf16", idx_ptr="i64", starts_ptr="i64", lens_ptr="i64",
                         slots_ptr="i64", out_ptr="fp32")
    attempt("lora bgmv shrink bf16 (a slot per decode row)", lambda: compile_kernel(
        lora._bgmv_kernel, lora_pointers, dict(scale="fp32"), dict(ADD=False, BLOCK_N=64, BLOCK_K=64), target,
        num_warps=4))
    attempt("lora sgmv expand bf16 (prefill segments)", lambda: compile_kernel(
        lora._sgmv_kernel, dict(lora_pointers, out_ptr="bf16"), dict(scale="fp32"),
        dict(ADD=True, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32), target, num_warps=4))
    moe = importlib.import_module("servelab.kernels.fused_moe")
    moe_index = dict(sorted_ids_ptr="i64", block_expert_ptr="i64")
    attempt("fused_moe gate/up + silu bf16 (top-8)", lambda: compile_kernel(
        moe._gate_up_kernel, dict(moe_index, x_ptr="bf16", w13_ptr="bf16", out_ptr="bf16"), {},
        dict(TOP_K=8, ACTIVATION=0, BLOCK_M=moe.BLOCK_M, BLOCK_N=64, BLOCK_K=64, IEEE=False, UPCAST=False), target,
        num_warps=4))
    attempt("fused_moe down x routing weight bf16", lambda: compile_kernel(
        moe._down_kernel, dict(moe_index, a_ptr="bf16", w2_ptr="bf16", weights_ptr="fp32", out_ptr="fp32"), {},
        dict(BLOCK_M=moe.BLOCK_M, BLOCK_N=64, BLOCK_K=64, IEEE=False, UPCAST=False), target, num_warps=4))
    for result in results:
        print(json.dumps(result))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
