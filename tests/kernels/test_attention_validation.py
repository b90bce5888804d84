"""Bad inputs: kernels and references reject the same inputs with errors naming the argument."""

import inspect
import math

import pytest
import torch

from attention_cases import INTERPRETER_ON, build_case

from servelab import kernels, reference

IMPLS = {"kernel": kernels, "reference": reference}


def accepts(impl, op, **args):
    """The unmutated input runs (the kernel only where it can launch: under the interpreter).

    Validation itself happens before any launch, so the rejections below are
    checked for both implementations either way.
    """
    if impl == "reference" or INTERPRETER_ON:
        getattr(IMPLS[impl], op)(**args)


def valid_attention_args():
    case = build_case([1, 3], [9, 3], num_q_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                      dtype=torch.float32, spare_blocks=1)
    return dict(zip(["query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc"],
                    case.args()))


def _with(**changes):
    def mutate(args, options):
        args.update({k: v(args) for k, v in changes.items() if k in args})
        options.update({k: v(args) for k, v in changes.items() if k not in args})
    return mutate


def _set(name, index, value):
    def change(args):
        tensor = args[name].clone()
        tensor[index] = value
        return tensor
    return change


ATTENTION_CASES = {
    # id: (mutation, exception, pattern the message must contain)
    "q_heads_not_multiple": (_with(query=lambda a: a["query"][:, :3]), ValueError, r"3 heads.*2 KV heads"),
    "head_size_mismatch": (_with(query=lambda a: torch.randn(4, 4, 32)), ValueError, r"head_size"),
    "block_table_int64": (_with(block_table=lambda a: a["block_table"].long()), ValueError, r"block_table.*int32"),
    "seq_lens_int64": (_with(seq_lens=lambda a: a["seq_lens"].long()), ValueError, r"seq_lens.*int32"),
    "query_start_loc_float": (_with(query_start_loc=lambda a: a["query_start_loc"].float()), ValueError,
                              r"query_start_loc.*int32"),
    "block_past_cache": (_with(block_table=_set("block_table", (0, 1), 99)), ValueError,
                         r"block_table\[0, 1\]=99.*0\.\.3"),
    "negative_block": (_with(block_table=_set("block_table", (1, 0), -1)), ValueError, r"block_table\[1, 0\]=-1"),
    "seq_len_below_query_len": (_with(seq_lens=_set("seq_lens", 1, 2)), ValueError, r"seq_lens\[1\]=2.*query_len 3"),
    "seq_len_past_table": (_with(seq_lens=_set("seq_lens", 0, 40)), ValueError, r"seq_lens\[0\]=40.*block_table"),
    "value_cache_shape": (_with(value_cache=lambda a: a["value_cache"][:, :4]), ValueError, r"value_cache shape"),
    "key_cache_dtype": (_with(key_cache=lambda a: a["key_cache"].half()), ValueError, r"key_cache dtype"),
    "key_cache_3d": (_with(key_cache=lambda a: a["key_cache"][0]), ValueError, r"key_cache must be 4-D"),
    "query_start_loc_length": (_with(query_start_loc=lambda a: a["query_start_loc"][:2]), ValueError,
                               r"query_start_loc must have num_seqs \+ 1 = 3"),
    "block_table_rows": (_with(block_table=lambda a: a["block_table"][:1]), ValueError, r"block_table must have one row"),
    "query_start_loc_end": (_with(query_start_loc=_set("query_start_loc", 2, 3)), ValueError,
                            r"query_start_loc must start at 0 and end at num_tokens=4"),
    "query_start_loc_decreasing": (_with(query_start_loc=lambda a: torch.tensor([0, 3, 1, 4], dtype=torch.int32),
                                         seq_lens=lambda a: torch.tensor([9, 3, 3], dtype=torch.int32),
                                         block_table=lambda a: torch.cat([a["block_table"], a["block_table"][:1]])),
                                   ValueError, r"query_start_loc must be non-decreasing"),
    "query_not_tensor": (_with(query=lambda a: a["query"].tolist()), TypeError, r"query must be a torch.Tensor"),
    "query_2d": (_with(query=lambda a: a["query"][:, 0]), ValueError, r"query must be 3-D"),
    "query_int": (_with(query=lambda a: a["query"].int()), ValueError, r"query must have dtype"),
    "window_zero": (_with(sliding_window=lambda a: 0), ValueError, r"sliding_window must be >= 1"),
    "window_float": (_with(sliding_window=lambda a: 2.5), TypeError, r"sliding_window must be an int"),
    "window_bool": (_with(sliding_window=lambda a: True), TypeError, r"sliding_window must be an int"),
    "softcap_negative": (_with(softcap=lambda a: -1.0), ValueError, r"softcap must be finite and > 0, got -1.0"),
    "softcap_nan": (_with(softcap=lambda a: math.nan), ValueError, r"softcap must be finite"),
    "scale_zero": (_with(scale=lambda a: 0.0), ValueError, r"scale must be finite and > 0"),
    "causal_string": (_with(causal=lambda a: "yes"), TypeError, r"causal must be a bool"),
    "num_splits_zero": (_with(num_splits=lambda a: 0), ValueError, r"num_splits must be >= 1"),
    "out_shape": (_with(out=lambda a: torch.empty(4, 4, 8)), ValueError, r"out must match query"),
    "out_dtype": (_with(out=lambda a: torch.empty(4, 4, 16, dtype=torch.float16)), ValueError, r"out must match query"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case_id", ATTENTION_CASES)
def test_paged_attention_rejects(impl, case_id):
    mutate, error, pattern = ATTENTION_CASES[case_id]
    args, options = valid_attention_args(), {}
    accepts(impl, "paged_attention", **args)
    mutate(args, options)
    with pytest.raises(error, match=pattern):
        IMPLS[impl].paged_attention(**args, **options)


def test_kernel_only_limits():
    args = valid_attention_args()
    as64 = {k: (v.double() if v.is_floating_point() else v) for k, v in args.items()}
    reference.paged_attention(**as64)  # float64 math is the reference's job (checked before any launch)
    with pytest.raises(ValueError, match=r"float64 is not supported by the Triton kernel"):
        kernels.paged_attention(**as64)
    big = build_case([1], [3], num_q_heads=1, num_kv_heads=1, head_size=320, block_size=8, dtype=torch.float32)
    reference.paged_attention(*big.args())
    with pytest.raises(ValueError, match=r"head_size 320 exceeds the kernel's maximum 256"):
        kernels.paged_attention(*big.args())


def valid_write_args():
    return dict(key=torch.randn(3, 2, 16), value=torch.randn(3, 2, 16),
                key_cache=torch.zeros(4, 8, 2, 16), value_cache=torch.zeros(4, 8, 2, 16),
                slot_mapping=torch.tensor([0, -1, 31], dtype=torch.int64))


WRITE_CASES = {
    "key_heads": (dict(key=torch.randn(3, 3, 16)), ValueError, r"key shape \(3, 3, 16\) must be \[num_tokens, 2, 16\]"),
    "value_dtype": (dict(value=torch.randn(3, 2, 16).half()), ValueError, r"value dtype"),
    "value_tokens": (dict(value=torch.randn(2, 2, 16)), ValueError, r"value has 2 tokens but key has 3"),
    "slot_float": (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), ValueError, r"slot_mapping must have dtype"),
    "slot_past_cache": (dict(slot_mapping=torch.tensor([0, 32, 1])), ValueError, r"slot_mapping\[1\]=32.*0\.\.31"),
    "slot_below_minus_one": (dict(slot_mapping=torch.tensor([0, -2, 1])), ValueError, r"slot_mapping\[1\]=-2"),
    "slot_duplicate": (dict(slot_mapping=torch.tensor([5, 5, -1])), ValueError, r"slot_mapping writes the same slot twice"),
    "slot_too_long": (dict(slot_mapping=torch.tensor([0, 1, 2, 3])), ValueError, r"slot_mapping has 4 entries but key has only 3"),
    "cache_mismatch": (dict(value_cache=torch.zeros(4, 8, 2, 8)), ValueError, r"value_cache .* must match key_cache"),
    "key_not_tensor": (dict(key=None), TypeError, r"key must be a torch.Tensor"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case_id", WRITE_CASES)
def test_reshape_and_cache_rejects(impl, case_id):
    changes, error, pattern = WRITE_CASES[case_id]
    accepts(impl, "reshape_and_cache", **valid_write_args())
    with pytest.raises(error, match=pattern):
        IMPLS[impl].reshape_and_cache(**{**valid_write_args(), **changes})


def valid_merge_args():
    return dict(out_a=torch.randn(3, 2, 16), lse_a=torch.randn(3, 2),
                out_b=torch.randn(3, 2, 16), lse_b=torch.randn(3, 2))


MERGE_CASES = {
    "lse_shape": (dict(lse_a=torch.randn(3)), ValueError, r"lse_a shape \(3,\) must be \[num_tokens, num_heads\]"),
    "lse_dtype": (dict(lse_b=torch.randn(3, 2).half()), ValueError, r"lse_b must have dtype float32"),
    "out_b_shape": (dict(out_b=torch.randn(3, 2, 8)), ValueError, r"out_b .* must match out_a"),
    "lse_nan": (dict(lse_a=torch.tensor([[0.0, math.nan]] * 3)), ValueError, r"lse_a\[0, 1\]=nan"),
    "lse_pos_inf": (dict(lse_b=torch.tensor([[0.0, math.inf]] * 3)), ValueError, r"lse_b\[0, 1\]=inf"),
    "out_dtype": (dict(out=torch.empty(3, 2, 16, dtype=torch.float16)), ValueError, r"out must match out_a"),
    "out_a_2d": (dict(out_a=torch.randn(3, 2)), ValueError, r"out_a must be 3-D"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case_id", MERGE_CASES)
def test_merge_attn_states_rejects(impl, case_id):
    changes, error, pattern = MERGE_CASES[case_id]
    accepts(impl, "merge_attn_states", **valid_merge_args())
    with pytest.raises(error, match=pattern):
        IMPLS[impl].merge_attn_states(**{**valid_merge_args(), **changes})


@pytest.mark.parametrize("op", ["paged_attention", "reshape_and_cache", "merge_attn_states"])
def test_kernel_and_reference_share_the_signature(op):
    assert inspect.signature(getattr(kernels, op)) == inspect.signature(getattr(reference, op))
