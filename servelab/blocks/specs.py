"""KV-cache specs: what one layer needs per block of tokens.

A spec is a frozen description of one layer's cache, independent of how many
blocks exist or where they live. It answers two questions the engine asks
before allocating anything:

- ``page_size_bytes``: bytes one block occupies for one layer;
- ``max_memory_usage_bytes(max_model_len)``: bytes one request can ever hold
  for one layer (what a profiler needs to size the pool).

The hierarchy follows vLLM v1: ``MLAAttentionSpec`` *is a* ``FullAttentionSpec``
(same block accounting, smaller page), so it reuses the full-attention manager
through the registry's MRO lookup without registering anything of its own.
Every field is validated in ``__post_init__`` with a ``ValueError`` that names
the field, the value and what would be valid: ``python -O`` strips asserts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from servelab._internal.validation import check_int

# dtypes a KV cache may be stored in. Strings are accepted for convenience and
# resolved here, so the rest of the package only ever sees torch.dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
            "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def resolve_dtype(value: torch.dtype | str, field: str = "dtype") -> torch.dtype:
    """Return the ``torch.dtype`` for ``value`` (a dtype or one of its names)."""
    if isinstance(value, str):
        name = _ALIASES.get(value, value)
        if name not in KV_CACHE_DTYPES:
            raise ValueError(
                f"{field}={value!r} is not a KV-cache dtype; valid: {sorted(KV_CACHE_DTYPES)}"
            )
        return KV_CACHE_DTYPES[name]
    if isinstance(value, torch.dtype):
        if value not in KV_CACHE_DTYPES.values():
            raise ValueError(
                f"{field}={value} is not a KV-cache dtype; valid: {sorted(KV_CACHE_DTYPES)}"
            )
        return value
    raise TypeError(f"{field} must be a torch.dtype or a dtype name, got {type(value).__name__}")


def _require_positive_int(obj: object, field: str) -> None:
    check_int(field, getattr(obj, field), min_value=1)


def require_nonneg_int(value: object, name: str) -> int:
    """Kept for old callers: ``check_int(name, value, min_value=0)``."""
    return check_int(name, value, min_value=0)


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(a // -b)


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base of all specs: every cache is paged in blocks of ``block_size`` tokens."""

    block_size: int

    def __post_init__(self) -> None:
        _require_positive_int(self, "block_size")

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block occupies for one layer."""
        raise NotImplementedError(f"{type(self).__name__} does not define page_size_bytes")

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        """Most bytes a single request can hold for one layer."""
        raise NotImplementedError(f"{type(self).__name__} does not define max_memory_usage_bytes")

    def _check_max_model_len(self, max_model_len: int) -> None:
        check_int("max_model_len", max_model_len, min_value=1)


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """A per-token key/value cache of ``num_kv_heads x head_size`` elements."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    #: A quantized page's scale granularity (:mod:`servelab.blocks.kv_quant`): ``"token_head"``
    #: stores one float32 scale per token, KV head and tensor in the page (counted in
    #: ``page_size_bytes``); ``"tensor"`` / ``"head"`` scales are per layer, outside the pages;
    #: None for an unquantized cache.
    kv_scale: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive_int(self, "num_kv_heads")
        _require_positive_int(self, "head_size")
        # frozen: go through object.__setattr__ to store the resolved dtype.
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        self._check_kv_scale()

    def _check_kv_scale(self) -> None:
        from servelab.blocks.kv_quant import SCALE_GRANULARITIES, available_kv_cache_dtypes, is_quantized_dtype

        if self.kv_scale is None:
            return
        if self.kv_scale not in SCALE_GRANULARITIES:
            raise ValueError(f"kv_scale={self.kv_scale!r} is invalid; valid: None, {', '.join(SCALE_GRANULARITIES)}")
        if not is_quantized_dtype(self.dtype):
            raise ValueError(f"kv_scale={self.kv_scale!r} with dtype {self.dtype}, which is not a quantized KV "
                             f"format ({', '.join(available_kv_cache_dtypes())})")
        data_bytes = self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize
        if self.kv_scale == "token_head" and data_bytes % 4:
            raise ValueError(f"a token_head page needs block_size * num_kv_heads * head_size * itemsize "
                             f"= {data_bytes} divisible by 4 (its float32 scales follow the data)")

    @property
    def scale_bytes_per_tensor(self) -> int:
        """Bytes of one block's float32 scales for one tensor (K or V): ``block_size *
        num_kv_heads * 4`` with ``kv_scale="token_head"``, else 0."""
        return self.block_size * self.num_kv_heads * 4 if self.kv_scale == "token_head" else 0

    @property
    def num_tensors(self) -> int:
        """Tensors per token: 2 (K and V) for ordinary attention."""
        return 2

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block for one layer: the data and, for ``kv_scale="token_head"``, its scales."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        data = self.block_size * self.num_kv_heads * self.head_size * itemsize
        return self.num_tensors * (data + self.scale_bytes_per_tensor)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole context: a request holds one block per
    ``block_size`` tokens, up to ``max_model_len``."""

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        self._check_max_model_len(max_model_len)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one compressed latent vector per token
    (``head_size`` = kv_lora_rank + rope dim) stands for both K and V, so there
    is one tensor, one "head", and no separate V cache."""

    num_kv_heads: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_heads != 1:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} for MLAAttentionSpec: the latent cache has exactly 1 head"
            )

    @property
    def num_tensors(self) -> int:
        return 1


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention limited to the last ``sliding_window`` positions (position p
    sees keys j with p - j < sliding_window). Blocks that fall wholly out of the
    window go back to the pool while the request runs."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive_int(self, "sliding_window")

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        self._check_max_model_len(max_model_len)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max_model_len
        else:
            check_int("max_num_batched_tokens", max_num_batched_tokens, min_value=1)
        # One step computes up to max_num_batched_tokens new tokens, and the first
        # of them still needs the window - 1 tokens before it. The +1 covers a
        # window whose first token is not at a block boundary.
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return (cdiv(num_tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """A fixed-size recurrent state per request (Mamba / linear attention).

    ``shapes[i]`` and ``dtypes[i]`` describe the i-th state tensor of one
    request for one layer (e.g. a conv state and an SSM state). A request holds
    exactly one block whatever its length; ``block_size`` is only the token
    granularity the scheduler aligns to. Within a page, each state starts at an
    offset aligned to the largest itemsize so every state can be viewed with its
    own dtype.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.shapes, tuple) or not self.shapes:
            raise ValueError(f"shapes={self.shapes!r} must be a non-empty tuple of shape tuples")
        if not isinstance(self.dtypes, tuple) or len(self.dtypes) != len(self.shapes):
            raise ValueError(
                f"dtypes={self.dtypes!r} must be a tuple with one dtype per state shape ({len(self.shapes)})"
            )
        for i, shape in enumerate(self.shapes):
            if not isinstance(shape, tuple) or not shape or any(
                isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape
            ):
                raise ValueError(f"shapes[{i}]={shape!r} must be a non-empty tuple of positive ints")
        resolved = tuple(resolve_dtype(d, f"dtypes[{i}]") for i, d in enumerate(self.dtypes))
        object.__setattr__(self, "dtypes", resolved)

    @property
    def state_offsets_bytes(self) -> tuple[int, ...]:
        """Byte offset of each state tensor inside one page."""
        align = max(torch.empty((), dtype=d).element_size() for d in self.dtypes)
        offsets, cursor = [], 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            offsets.append(cursor)
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            cursor += cdiv(nbytes, align) * align
        return tuple(offsets)

    @property
    def page_size_bytes(self) -> int:
        align = max(torch.empty((), dtype=d).element_size() for d in self.dtypes)
        last = math.prod(self.shapes[-1]) * torch.empty((), dtype=self.dtypes[-1]).element_size()
        return cdiv(self.state_offsets_bytes[-1] + last, align) * align

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        self._check_max_model_len(max_model_len)
        return self.page_size_bytes


# ---- how many blocks a request holds under chunked prefill (vLLM's cap: sizes its pool and admits) ----

def request_blocks_cap(spec: KVCacheSpec, num_tokens: int, tokens_in_flight: int) -> int:
    """Most blocks one request of ``num_tokens`` tokens ever holds for ``spec``
    when at most ``tokens_in_flight`` of its tokens are computed per step: a
    sliding window ``cdiv(min(window - 1 + tokens_in_flight, num_tokens),
    block_size) + 1`` (a chunk's first token sees ``window - 1`` before it;
    ``+ 1`` for a window not starting on a block boundary; never more than
    the full count), a Mamba state 1, anything else ``cdiv(num_tokens, block_size)``."""
    full = cdiv(num_tokens, spec.block_size)
    if isinstance(spec, SlidingWindowSpec):
        return min(full, cdiv(min(spec.sliding_window - 1 + tokens_in_flight, num_tokens), spec.block_size) + 1)
    if isinstance(spec, MambaSpec):
        return 1 if num_tokens > 0 else 0
    return full


def blocks_needed_alone(specs: list[KVCacheSpec], num_tokens: int, tokens_in_flight: int) -> int:
    """Blocks of a shared pool (one per group in ``specs``) one request needs at most."""
    return sum(request_blocks_cap(spec, num_tokens, tokens_in_flight) for spec in specs)


def max_chunk_alone(specs: list[KVCacheSpec], num_tokens: int, usable_blocks: int, max_chunk: int) -> int:
    """The largest chunk ``c <= max_chunk`` with ``blocks_needed_alone(specs,
    num_tokens, c) <= usable_blocks`` (bisection: the need grows with the
    chunk); 0 when not even one token per step fits."""
    lo, hi = 0, max_chunk
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_needed_alone(specs, num_tokens, mid) <= usable_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
