"""Quantized KV-cache page formats: what an int8 / fp8 page stores and how it is read.

A quantized page keeps K and V in a narrow *storage dtype* (int8, float8_e4m3fn,
float8_e5m2) and a float32 *scale* beside them; the value a kernel attends over is
``stored.float() * scale``. The scale is one of three granularities
(``kv_cache_scale``):

- ``"token_head"`` (the default of every format here): one scale per token and KV
  head, computed when the token is written (``amax(|x|) / max_value`` over the
  head's ``D`` elements) and stored in the page beside the data, so
  ``page_size_bytes`` counts ``2 * block_size * num_kv_heads * 4`` more bytes;
- ``"head"``: one static scale per layer and KV head (for K and for V);
- ``"tensor"``: one static scale per layer (for K and for V), vLLM's per-tensor
  scale. Static scales are 1.0 until :func:`servelab.pipeline.kv_calibration.calibrate_kv_scales`
  fills them from real activations (values beyond ``max_value * scale`` saturate).

**One scale interface for every kernel.** Every attention path takes the scales as
two float32 tensors ``k_scale`` / ``v_scale`` *broadcast to* ``[N, B, Hk]`` (the
cache's blocks, tokens and KV heads): a page view for ``"token_head"``, a stride-0
expansion of a per-layer ``[Hk]`` tensor for ``"head"`` / ``"tensor"``. So
``dequantize(cache, scale) = cache.float() * scale[..., None]`` is the whole
semantics, and a kernel reads the scale of ``(block, token, head)`` through its
strides (``0`` for a static scale). A write computes and stores each row's scale
when the scale view has real strides, and quantizes with the given static scale
when its block and token strides are 0 (:func:`is_static_scale`).

**Key smoothing** (:func:`key_smoothing_factors`, folded into a model by
:func:`servelab.pipeline.kv_calibration.calibrate_key_smoothing`): a few RoPE channel pairs of a
model's keys can be 10x larger than the rest (Gemma 3), so a per-token scale, set by them, is
coarse for every other channel. Dividing K by a calibrated per-channel factor ``m`` before it is
written and multiplying the query by ``m`` keeps every ``q . k`` exact and flattens the rows the
per-token scale sees. ``m`` is equal on the two channels of a RoPE pair (``c`` and ``c + D/2``),
so it commutes with the rotation and is folded into the query / key weights once: the pages,
scales and kernels are unchanged.

Adding a scheme is registering a :class:`KVCacheFormat` (its storage dtype, the
largest magnitude it stores, and its rounding); the torch paths (references,
``"sdpa"``) read it at once, and a fast kernel declares it in its backend's
``capabilities.kv_cache_dtypes``. The references of quantize / dequantize are in
:mod:`servelab.reference.kv_quant` (float64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from servelab._internal.registry import Registry

__all__ = [
    "KVCacheFormat", "ScaledFormat", "available_kv_cache_dtypes", "dequantize", "get_kv_cache_dtype",
    "is_quantized_dtype", "is_static_scale", "quantize_rows", "register_kv_cache_dtype", "row_scales",
    "SCALE_DTYPE", "SCALE_GRANULARITIES", "DEFAULT_SCALE", "key_smoothing_factors",
]

#: Scales are float32 everywhere (pages, static tensors, kernels).
SCALE_DTYPE = torch.float32
SCALE_GRANULARITIES = ("tensor", "head", "token_head")
#: The granularity ``kv_cache_scale=None`` means, per format: token_head for all of them
#: (the accuracy study, docs/kv_cache_quantization.md: per-tensor int8 at scale 1.0 is unusable
#: and even calibrated static scales lose more than per-token ones).
DEFAULT_SCALE = "token_head"


@runtime_checkable
class KVCacheFormat(Protocol):
    """A quantized KV page format.

    Attributes:
        name: registry name (``"int8"``).
        storage_dtype: the dtype of the K/V data in the page.
        max_value: the largest magnitude stored; a token-head scale is ``amax / max_value``.
    """

    name: str
    storage_dtype: torch.dtype
    max_value: float

    def quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``x`` float ``[..., D]`` over ``scale`` float32 ``[...]`` -> ``storage_dtype`` ``[..., D]``
        (saturating at ``max_value``)."""
        ...

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``q`` ``[..., D]`` times ``scale`` ``[...]`` -> ``dtype`` ``[..., D]``."""
        ...


@dataclass(frozen=True)
class ScaledFormat:
    """``q = round(x / scale)`` clamped to ``±max_value``: int8 rounds half to even and
    clamps to ±127 (symmetric: -128 is never written); a float8 format clamps, then lets
    the cast round to nearest even."""

    name: str
    storage_dtype: torch.dtype
    max_value: float

    def quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = (x.to(compute) / scale.to(compute)[..., None]).clamp_(-self.max_value, self.max_value)
        if not self.storage_dtype.is_floating_point:
            y = y.round_()
        return y.to(self.storage_dtype)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        return (q.to(compute) * scale.to(compute)[..., None]).to(dtype)


def _check_format(obj: object) -> None:
    missing = [m for m in ("name", "storage_dtype", "max_value", "quantize", "dequantize") if not hasattr(obj, m)]
    if missing:
        raise TypeError(f"a KV-cache format needs {', '.join(missing)}; {type(obj).__name__} lacks them")
    if not isinstance(obj.storage_dtype, torch.dtype):  # type: ignore[attr-defined]
        raise TypeError(f"{type(obj).__name__}.storage_dtype must be a torch.dtype")


_REGISTRY: Registry[KVCacheFormat] = Registry("KV-cache dtype", check=_check_format)
_REGISTRY.register("int8", ScaledFormat("int8", torch.int8, 127.0))
_REGISTRY.register("fp8_e4m3", ScaledFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0))
_REGISTRY.register("fp8_e5m2", ScaledFormat("fp8_e5m2", torch.float8_e5m2, 57344.0))
_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's name


def register_kv_cache_dtype(name: str, fmt: KVCacheFormat, *, override: bool = False) -> None:
    """Make ``kv_cache_dtype=name`` store pages in ``fmt`` (a :class:`KVCacheFormat`)."""
    _REGISTRY.register(name, fmt, override=override)


def available_kv_cache_dtypes() -> list[str]:
    """Registered format names (``"auto"``, the model's dtype, is not a format)."""
    return sorted([*_REGISTRY.available(), *_ALIASES])


def get_kv_cache_dtype(name_or_obj: str | KVCacheFormat) -> KVCacheFormat:
    """The format registered as ``name_or_obj`` (``"fp8"`` = ``"fp8_e4m3"``), or the object."""
    if isinstance(name_or_obj, str):
        name_or_obj = _ALIASES.get(name_or_obj, name_or_obj)
    return _REGISTRY.get(name_or_obj)


def format_of_dtype(dtype: torch.dtype) -> KVCacheFormat | None:
    """The registered format storing ``dtype`` (the first registered), or None."""
    for name in _REGISTRY.available():
        fmt = _REGISTRY.get(name)
        if fmt.storage_dtype == dtype:
            return fmt
    return None


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds quantized data (a registered storage dtype)."""
    return format_of_dtype(dtype) is not None


def is_static_scale(scale: torch.Tensor) -> bool:
    """A ``[N, B, Hk]`` scale whose block and token strides are 0: one value per layer (and
    head), written by calibration, read-only for cache writes."""
    # a size-1 token axis may keep any stride (torch's expand), so only a longer one is checked
    return scale.stride(0) == 0 and (scale.stride(1) == 0 or scale.shape[1] == 1)


def row_scales(x: torch.Tensor, fmt: KVCacheFormat) -> torch.Tensor:
    """Per-row scales of ``x`` float ``[T, Hk, D]``: ``amax(|x|) / max_value`` float32 ``[T, Hk]``
    (1.0 for an all-zero row, whose data quantizes to 0 whatever the scale)."""
    amax = x.abs().amax(dim=-1).to(SCALE_DTYPE)
    return torch.where(amax > 0, amax / fmt.max_value, torch.ones_like(amax))


def quantize_rows(x: torch.Tensor, fmt: KVCacheFormat, scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` float ``[T, Hk, D]`` -> (data ``[T, Hk, D]`` in ``fmt.storage_dtype``, scales float32
    ``[T, Hk]``): with ``scale`` None each row's own scale (:func:`row_scales`), else ``scale``
    broadcast to ``[T, Hk]`` (a static one)."""
    scales = row_scales(x, fmt) if scale is None else scale.to(SCALE_DTYPE).expand(x.shape[:2])
    return fmt.quantize(x, scales), scales


def dequantize(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``cache`` ``[..., Hk, D]`` (a storage dtype) times ``scale`` ``[..., Hk]`` -> ``dtype``."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (cache.to(compute) * scale.to(compute)[..., None]).to(dtype)


def check_kv_scales(key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: object, v_scale: object) -> None:
    """``k_scale`` / ``v_scale`` float32 ``[N, B, Hk]`` (any strides) for quantized caches of a
    registered storage dtype; ``ValueError`` / ``TypeError`` naming the argument otherwise."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if (scale is None) != (k_scale is None):
            raise ValueError("k_scale and v_scale must be given together")
        if scale is None:
            continue
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
        if scale.dtype != SCALE_DTYPE:
            raise ValueError(f"{name} dtype {scale.dtype} is invalid; valid: torch.float32")
        if tuple(scale.shape) != tuple(key_cache.shape[:3]):
            raise ValueError(f"{name} shape {tuple(scale.shape)} must be [num_blocks, block_size, num_kv_heads]"
                             f" = {tuple(key_cache.shape[:3])} (a static scale expanded to it)")
        if scale.device != key_cache.device:
            raise ValueError(f"{name} is on {scale.device}, the cache on {key_cache.device}")
    quantized = is_quantized_dtype(key_cache.dtype)
    if quantized and k_scale is None:
        raise ValueError(f"key_cache dtype {key_cache.dtype} is a quantized KV format: pass k_scale and v_scale "
                         "(float32 [num_blocks, block_size, num_kv_heads])")
    if not quantized and k_scale is not None:
        raise ValueError(f"k_scale / v_scale were given with key_cache dtype {key_cache.dtype}, which is not a "
                         f"quantized KV format (storage dtypes: {sorted({str(_REGISTRY.get(n).storage_dtype) for n in _REGISTRY.available()})})")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache dtype {value_cache.dtype} must equal key_cache dtype {key_cache.dtype}")


def kv_cache_storage(kv_cache_dtype: str, kv_cache_scale: str | None, model_dtype: torch.dtype
                     ) -> tuple[torch.dtype, str | None]:
    """What ``kv_cache_dtype`` / ``kv_cache_scale`` (the settings) mean for the pages: the
    storage dtype and the scale granularity (None for ``"auto"``, the model's dtype; the
    format's default, :data:`DEFAULT_SCALE`, when ``kv_cache_scale`` is None)."""
    if kv_cache_dtype == "auto":
        if kv_cache_scale is not None:
            raise ValueError(f"kv_cache_scale={kv_cache_scale!r} with kv_cache_dtype='auto', whose pages hold no "
                             "scales; choose a quantized kv_cache_dtype or leave the scale out")
        return model_dtype, None
    try:
        fmt = get_kv_cache_dtype(kv_cache_dtype)
    except ValueError:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is invalid; valid: 'auto', "
                         f"{', '.join(map(repr, available_kv_cache_dtypes()))}") from None
    granularity = DEFAULT_SCALE if kv_cache_scale is None else kv_cache_scale
    if granularity not in SCALE_GRANULARITIES:
        raise ValueError(f"kv_cache_scale={kv_cache_scale!r} is invalid; valid: None, "
                         f"{', '.join(map(repr, SCALE_GRANULARITIES))}")
    return fmt.storage_dtype, granularity


def key_smoothing_factors(amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-channel key smoothing factors from calibrated ``|K|`` maxima.

    ``amax`` float ``[..., D]`` (``D`` even; the largest ``|K|`` of each channel) -> float32
    ``[..., D]``: ``m = (a / max(a)) ** alpha`` where ``a`` is ``amax`` tied over RoPE pairs
    (channel ``c`` and ``c + D/2`` both take the larger: RoPE mixes them, so only a factor equal on
    both commutes with it) and floored at ``1e-3 * max(a)`` (a dead channel must not be divided by
    0). ``alpha`` in ``[0, 1]``: 0 is no smoothing (all ones), 1 flattens every channel's maximum
    to the same value. The reference is :func:`servelab.reference.kv_quant.key_smoothing_factors`."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} is invalid; valid: a number in [0, 1]")
    if not isinstance(amax, torch.Tensor) or not amax.is_floating_point():
        raise TypeError(f"amax must be a floating torch.Tensor, got {type(amax).__name__}")
    if amax.dim() == 0 or amax.shape[-1] % 2:
        raise ValueError(f"amax shape {tuple(amax.shape)} is invalid; valid: [..., D] with D even (RoPE pairs)")
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise ValueError("amax holds a value that is negative or not finite; valid: maxima of |K|")
    a = amax.to(torch.float64).abs()
    half = a.shape[-1] // 2
    tied = torch.maximum(a[..., :half], a[..., half:])
    a = torch.cat((tied, tied), dim=-1)
    top = a.amax(dim=-1, keepdim=True)
    a = torch.where(top > 0, a / torch.where(top > 0, top, torch.ones_like(top)), torch.ones_like(a))
    return a.clamp_min(1e-3).pow(float(alpha)).to(SCALE_DTYPE)
