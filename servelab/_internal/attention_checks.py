"""Argument validation shared by the attention kernels and their references.

Both :mod:`servelab.kernels` and :mod:`servelab.reference` call these checks
first, so the two implementations accept and reject exactly the same inputs.
This module lives beside the references (which never import Triton) so that
the torch backend keeps working on machines without Triton.

Errors name the argument, the offending value and what would be valid:

- ``TypeError`` when an argument is not the kind of object expected (not a
  tensor, a window that is not an integer, ...);
- ``ValueError`` for everything about a tensor's contents, shape or dtype.

Checks that read tensor *contents* (``check_values=True``) copy a few small
int32 tensors to the host; that costs one device synchronisation, so callers
timing kernels pass ``check_inputs=False``.
"""

from __future__ import annotations

import math
import numbers

import torch

# Float dtypes the attention ops understand. The Triton kernels narrow this
# (float64 is reference-only: tests use it for float64 math).
ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _require_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(
            f"{name} must be {ndim}-D {layout}, got shape {tuple(tensor.shape)}"
        )


def _require_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{name} must have dtype {names}; got {tensor.dtype}")


def _require_same_device(reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, tensor in others.items():
        if tensor.device != reference.device:
            raise ValueError(
                f"{name} is on {tensor.device} but {reference_name} is on "
                f"{reference.device}; all tensors must be on one device"
            )


def _positive_finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def _check_quantized_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: object,
                            v_scale: object) -> bool:
    """Whether the caches are quantized (checked with their scales by
    :func:`servelab.blocks.kv_quant.check_kv_scales`)."""
    if not isinstance(key_cache, torch.Tensor) or not isinstance(value_cache, torch.Tensor):
        return False
    from servelab.blocks.kv_quant import check_kv_scales, is_quantized_dtype

    if key_cache.dim() == 4:
        check_kv_scales(key_cache, value_cache, k_scale, v_scale)
    return is_quantized_dtype(key_cache.dtype)


def check_paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor | None,
    num_splits: int | None,
    check_values: bool,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> float:
    """Validate ``paged_attention`` arguments; return the resolved ``scale``.

    A quantized cache (int8 / fp8 storage, :mod:`servelab.blocks.kv_quant`) comes with
    ``k_scale`` / ``v_scale`` float32 ``[num_blocks, block_size, num_kv_heads]``.

    Layout recap: ``query`` ``[num_tokens, num_q_heads, head_size]``; caches
    ``[num_blocks, block_size, num_kv_heads, head_size]``; ``block_table`` int32
    ``[num_seqs, max_blocks_per_seq]``; ``seq_lens`` int32 ``[num_seqs]``;
    ``query_start_loc`` int32 ``[num_seqs + 1]``.
    """
    tensors = {
        "query": query, "key_cache": key_cache, "value_cache": value_cache,
        "block_table": block_table, "seq_lens": seq_lens, "query_start_loc": query_start_loc,
    }
    _check_query_and_caches(query, key_cache, value_cache, tensors, k_scale, v_scale)
    num_tokens, head_size = query.shape[0], query.shape[2]
    num_seqs = _check_batch_layout(tensors, out)
    _check_options(causal, sliding_window, softcap, num_splits)
    resolved_scale = 1.0 / math.sqrt(head_size) if scale is None else _positive_finite("scale", scale)

    if check_values and num_seqs > 0:
        _check_batch_values(query, key_cache, block_table, seq_lens, query_start_loc)
    elif check_values and num_tokens != 0:
        raise ValueError(f"query has {num_tokens} tokens but the batch has no sequences")
    return resolved_scale


def _check_query_and_caches(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            tensors: dict[str, object], k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> None:
    """Every argument a tensor; query ``[T, Hq, D]`` and the two caches ``[N, B, Hkv, D]`` agree."""
    for name, value in tensors.items():
        _require_tensor(name, value)
    _require_ndim("query", query, 3, "[num_tokens, num_q_heads, head_size]")
    _require_dtype("query", query, ATTENTION_DTYPES)
    quantized = _check_quantized_caches(key_cache, value_cache, k_scale, v_scale)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _require_ndim(name, cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
        if cache.dtype != query.dtype and not quantized:
            raise ValueError(f"{name} dtype {cache.dtype} must equal query dtype {query.dtype}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} must equal key_cache shape "
            f"{tuple(key_cache.shape)}"
        )
    num_q_heads, head_size = query.shape[1], query.shape[2]
    block_size, num_kv_heads, cache_head_size = key_cache.shape[1:]
    if cache_head_size != head_size:
        raise ValueError(
            f"key_cache head_size {cache_head_size} must equal query head_size {head_size}"
        )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"query has {num_q_heads} heads, which is not a multiple of key_cache's "
            f"{num_kv_heads} KV heads (GQA/MQA needs num_q_heads % num_kv_heads == 0)"
        )
    if head_size == 0 or block_size == 0:
        raise ValueError(f"head_size and block_size must be > 0, got {head_size} and {block_size}")


def _check_batch_layout(tensors: dict[str, torch.Tensor], out: torch.Tensor | None) -> int:
    """``block_table`` / ``seq_lens`` / ``query_start_loc`` shapes, dtypes and devices, and
    ``out``; returns the number of sequences."""
    for name, ndim, layout in (
        ("block_table", 2, "[num_seqs, max_blocks_per_seq]"),
        ("seq_lens", 1, "[num_seqs]"),
        ("query_start_loc", 1, "[num_seqs + 1]"),
    ):
        _require_ndim(name, tensors[name], ndim, layout)
        _require_dtype(name, tensors[name], (torch.int32,))
    num_seqs = tensors["seq_lens"].shape[0]
    if tensors["query_start_loc"].shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
            f"got {tensors['query_start_loc'].shape[0]}"
        )
    if tensors["block_table"].shape[0] != num_seqs:
        raise ValueError(
            f"block_table must have one row per sequence ({num_seqs}), got {tensors['block_table'].shape[0]}"
        )
    query = tensors["query"]
    _require_same_device("query", query, **{k: v for k, v in tensors.items() if k != "query"})
    if out is not None:
        _require_tensor("out", out)
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(
                f"out must match query: shape {tuple(query.shape)} dtype {query.dtype}; "
                f"got shape {tuple(out.shape)} dtype {out.dtype}"
            )
        _require_same_device("query", query, out=out)
    return num_seqs


def _check_options(causal: object, sliding_window: object, softcap: object, num_splits: object) -> None:
    """The keyword options: types and ranges."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
            raise TypeError(f"sliding_window must be an int or None, got {sliding_window!r}")
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None for no window), got {sliding_window}")
    if softcap is not None:
        _positive_finite("softcap", softcap)
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
            raise TypeError(f"num_splits must be an int or None, got {num_splits!r}")
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 (or None for the heuristic), got {num_splits}")


def _check_batch_values(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    num_tokens = query.shape[0]
    num_blocks, block_size = key_cache.shape[:2]
    starts = query_start_loc.cpu().long()
    lens = seq_lens.cpu().long()
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc must start at 0 and end at num_tokens={num_tokens}, "
            f"got first {int(starts[0])} and last {int(starts[-1])}"
        )
    query_lens = starts[1:] - starts[:-1]
    if (query_lens < 0).any():
        i = int(torch.nonzero(query_lens < 0)[0])
        raise ValueError(
            f"query_start_loc must be non-decreasing; entry {i + 1} ({int(starts[i + 1])}) "
            f"< entry {i} ({int(starts[i])})"
        )
    too_short = lens < query_lens
    if too_short.any():
        i = int(torch.nonzero(too_short)[0])
        raise ValueError(
            f"seq_lens[{i}]={int(lens[i])} is smaller than that sequence's query_len "
            f"{int(query_lens[i])}; seq_lens counts cached tokens including this step's"
        )
    capacity = block_table.shape[1] * block_size
    too_long = lens > capacity
    if too_long.any():
        i = int(torch.nonzero(too_long)[0])
        raise ValueError(
            f"seq_lens[{i}]={int(lens[i])} exceeds what block_table can address: "
            f"{block_table.shape[1]} blocks x block_size {block_size} = {capacity} tokens"
        )
    # Only the entries a sequence actually uses must be valid block ids; the
    # tail of each row is padding and may hold anything.
    blocks_used = (lens + block_size - 1) // block_size
    columns = torch.arange(block_table.shape[1])
    in_use = columns[None, :] < blocks_used[:, None]
    table = block_table.cpu().long()
    bad = in_use & ((table < 0) | (table >= num_blocks))
    if bad.any():
        i, j = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(
            f"block_table[{i}, {j}]={int(table[i, j])} points outside the cache "
            f"(valid block ids are 0..{num_blocks - 1})"
        )


def check_reshape_and_cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Validate ``reshape_and_cache`` arguments.

    A quantized cache comes with ``k_scale`` / ``v_scale`` (see :func:`check_paged_attention_args`);
    its ``key`` / ``value`` are then float (any attention dtype), quantized by the write.

    ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` with the caches'
    dtype; caches ``[num_blocks, block_size, num_kv_heads, head_size]``;
    ``slot_mapping`` int32/int64 ``[n]`` with ``n <= num_tokens`` (rows past
    ``n`` are padding and are not written). Slots are ``-1`` (skip) or
    ``0 <= slot < num_blocks * block_size``, each used at most once.
    """
    tensors = {
        "key": key, "value": value, "key_cache": key_cache,
        "value_cache": value_cache, "slot_mapping": slot_mapping,
    }
    for name, tensor in tensors.items():
        _require_tensor(name, tensor)
    quantized = _check_quantized_caches(key_cache, value_cache, k_scale, v_scale)
    for name in ("key_cache", "value_cache"):
        _require_ndim(name, tensors[name], 4, "[num_blocks, block_size, num_kv_heads, head_size]")
        if not quantized:
            _require_dtype(name, tensors[name], ATTENTION_DTYPES)
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache ({tuple(value_cache.shape)}, {value_cache.dtype}) must match "
            f"key_cache ({tuple(key_cache.shape)}, {key_cache.dtype})"
        )
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    for name in ("key", "value"):
        tensor = tensors[name]
        _require_ndim(name, tensor, 3, "[num_tokens, num_kv_heads, head_size]")
        if tuple(tensor.shape[1:]) != (num_kv_heads, head_size):
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} must be [num_tokens, {num_kv_heads}, "
                f"{head_size}] to match the cache's num_kv_heads and head_size"
            )
        if quantized:
            _require_dtype(name, tensor, ATTENTION_DTYPES)
        elif tensor.dtype != key_cache.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} must equal the cache dtype {key_cache.dtype}")
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value has {value.shape[0]} tokens but key has {key.shape[0]}")
    _require_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    _require_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but key has only {key.shape[0]} tokens"
        )
    _require_same_device("key", key, **{k: v for k, v in tensors.items() if k != "key"})
    if check_values and slot_mapping.numel() > 0:
        slots = slot_mapping.cpu().long()
        num_slots = num_blocks * block_size
        bad = (slots < -1) | (slots >= num_slots)
        if bad.any():
            i = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"slot_mapping[{i}]={int(slots[i])} is outside the cache: valid slots are "
                f"-1 (skip) and 0..{num_slots - 1}"
            )
        real = slots[slots >= 0]
        if real.unique().numel() != real.numel():
            raise ValueError("slot_mapping writes the same slot twice; each slot may appear once per call")


def check_merge_attn_states_args(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None,
    check_values: bool,
) -> None:
    """Validate ``merge_attn_states`` arguments.

    ``out_a``/``out_b`` ``[num_tokens, num_heads, head_size]`` of one float
    dtype; ``lse_a``/``lse_b`` float32 (or float64 with float64 outputs)
    ``[num_tokens, num_heads]``, natural-log sums; ``-inf`` marks an empty
    partial. NaN or ``+inf`` LSEs are rejected when ``check_values``.
    """
    tensors = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
    for name, tensor in tensors.items():
        _require_tensor(name, tensor)
    _require_ndim("out_a", out_a, 3, "[num_tokens, num_heads, head_size]")
    _require_dtype("out_a", out_a, ATTENTION_DTYPES)
    if out_b.shape != out_a.shape or out_b.dtype != out_a.dtype:
        raise ValueError(
            f"out_b ({tuple(out_b.shape)}, {out_b.dtype}) must match out_a "
            f"({tuple(out_a.shape)}, {out_a.dtype})"
        )
    lse_dtypes = (torch.float64,) if out_a.dtype == torch.float64 else (torch.float32,)
    for name in ("lse_a", "lse_b"):
        lse = tensors[name]
        if tuple(lse.shape) != tuple(out_a.shape[:2]):
            raise ValueError(
                f"{name} shape {tuple(lse.shape)} must be [num_tokens, num_heads] = "
                f"{tuple(out_a.shape[:2])}"
            )
        _require_dtype(name, lse, lse_dtypes)
    if out is not None:
        _require_tensor("out", out)
        if out.shape != out_a.shape or out.dtype != out_a.dtype:
            raise ValueError(
                f"out must match out_a ({tuple(out_a.shape)}, {out_a.dtype}); "
                f"got ({tuple(out.shape)}, {out.dtype})"
            )
        tensors["out"] = out
    _require_same_device("out_a", out_a, **{k: v for k, v in tensors.items() if k != "out_a"})
    if check_values:
        for name in ("lse_a", "lse_b"):
            lse = tensors[name]
            bad = torch.isnan(lse) | (lse == math.inf)
            if bad.any():
                index = tuple(int(x) for x in torch.nonzero(bad)[0])
                raise ValueError(
                    f"{name}{list(index)}={float(lse[index])} is not a valid log-sum-exp "
                    "(finite, or -inf for an empty partial)"
                )
