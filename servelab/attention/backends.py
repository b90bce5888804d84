"""Attention backends: the interface, the registry, and the built-in backends.

>>> backend = get_attention_backend("sdpa")
>>> reason = backend.supports(query, key_cache)   # None, or why it can't
>>> out = backend.paged_attention(query, key_cache, value_cache, block_table,
...                               seq_lens, query_start_loc)

Built-in names:

- ``"sdpa"``: paged attention as batched ``scaled_dot_product_attention``
  calls (:mod:`servelab.attention.sdpa`), the fast choice on a CPU;
- ``"torch"``: the PyTorch references (:mod:`servelab.reference`), slow and
  obviously correct, float64 included; registered lazily, so importing this
  module never imports the references;
- ``"triton"``: the Triton kernels of :mod:`servelab.kernels` (CUDA, or CPU
  under ``TRITON_INTERPRET=1``), imported on first use;
- ``"auto"`` is not a backend but a request: :func:`default_attention_backend`
  picks ``"triton"`` on CUDA and ``"sdpa"`` elsewhere.

Every backend is an :class:`AttentionBackend`: a capability declaration
(:class:`AttentionCapabilities`, every field defaulted) plus three ops with
the signatures of the references (``paged_attention``,
``reshape_and_cache``, ``merge_attn_states``) and an optional per-step
``plan``. Only ``_paged_attention`` is abstract: the KV write and the state
merge default to vectorised torch code (:mod:`servelab.attention.ops`).
``supports(...)`` returns ``None`` when the backend can take the input and
otherwise a sentence saying why not; the public ops raise
:class:`UnsupportedInputError` with that sentence rather than falling back to
another backend.

A researcher's own backend, through the public API only::

    class Scaled(AttentionBackend):
        name = "scaled-sdpa"
        def _paged_attention(self, query, *args, **kwargs):
            return get_attention_backend("sdpa").paged_attention(query, *args, **kwargs)
    register_attention_backend("scaled-sdpa", Scaled)
    model.attention = "scaled-sdpa"

The registry is :class:`servelab._internal.registry.Registry`:
``register_attention_backend(name, backend, *, override=False)`` (a class or
factory called on every lookup, an instance, or a lazy ``"module:attr"``
string), ``get_attention_backend(name_or_obj)``,
``available_attention_backends()``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from servelab._internal.registry import Registry
from servelab._internal.tree_mask import TreeMask
from servelab.attention import cpu_decode
from servelab.attention.triton_device import triton_device_problem  # re-exported: callers import it from here

__all__ = [
    "AttentionBackend",
    "AttentionCapabilities",
    "SdpaAttentionBackend",
    "TreeMask",
    "TritonAttentionBackend",
    "UnsupportedInputError",
    "available_attention_backends",
    "default_attention_backend",
    "get_attention_backend",
    "register_attention_backend",
    "triton_device_problem",
]


class UnsupportedInputError(ValueError):
    """A backend was asked to run on an input it declared it cannot take."""


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend can take. ``None`` limits mean "no limit"; every field has a default.

    Attributes:
        dtypes: query / KV-cache dtypes accepted (default float16, bfloat16, float32).
        max_head_size: largest head size (any size up to it, powers of two or not).
        block_sizes: accepted KV-cache block sizes as an inclusive ``(min, max)``.
        device_types: torch device types the ops run on (further narrowed at run
            time by :meth:`AttentionBackend.device_problem`).
        features: optional features implemented, among ``"causal"`` (and
            non-causal), ``"gqa"``, ``"sliding_window"``, ``"softcap"``,
            ``"split_kv"``, ``"return_lse"``, ``"tree"`` (a :class:`~servelab.attention.TreeMask`:
            token trees verified in one step), ``"plan_chaining"`` (:meth:`AttentionBackend.plan`
            takes ``chain`` / ``previous``). Asking for ``sliding_window``,
            ``softcap`` or ``return_lse`` without the feature is refused.
        supported_kv_cache_dtypes: the ``kv_cache_dtype`` pages it reads (vLLM's names):
            ``"auto"`` (the query's dtype) and quantized formats of
            :mod:`servelab.blocks.kv_quant` (``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``), read
            with their ``k_scale`` / ``v_scale``; ``"any"``: every registered format (a torch
            path that reads ``data * scale`` generically).
    """

    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
    supported_kv_cache_dtypes: tuple[str, ...] = ("auto",)
    max_head_size: int | None = None
    block_sizes: tuple[int, int | None] = (1, None)
    device_types: tuple[str, ...] = ("cpu", "cuda")
    features: frozenset[str] = field(default_factory=lambda: frozenset({"causal", "gqa"}))


class AttentionBackend(ABC):
    """A named set of attention ops plus a capability declaration.

    Subclasses set ``name`` (and ``capabilities`` when the defaults do not
    fit) and implement ``_paged_attention``; ``_reshape_and_cache``,
    ``_merge_attn_states`` and ``plan`` have working defaults. The public
    methods check :meth:`supports` first and refuse unsupported inputs with
    the reason. Shapes (``T`` tokens this step, ``S`` sequences, ``Hq`` / ``Hk``
    query / KV heads, ``D`` head size, ``N`` cache blocks of ``B`` tokens):

    - ``query`` ``[T, Hq, D]``; ``key_cache`` / ``value_cache`` ``[N, B, Hk, D]``
      ("NHD", same dtype as the query, possibly strided views of one buffer);
    - ``block_table`` int32 ``[S, max_blocks]``, ``seq_lens`` int32 ``[S]``
      (tokens in the cache *including* this step's), ``query_start_loc`` int32
      ``[S + 1]`` (sequence ``i`` owns query rows ``qsl[i]:qsl[i+1]``, which sit
      at the last positions of the sequence);
    - ``slot_mapping`` int32/int64 ``[T]`` (``-1`` = skip), ``lse`` float32 ``[T, H]``.
    """

    name: str = ""
    capabilities: AttentionCapabilities = AttentionCapabilities()

    # ---- capabilities ----------------------------------------------------

    def device_problem(self, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` right now, or ``None``."""
        if device.type not in self.capabilities.device_types:
            return (
                f"backend {self.name!r} runs on {', '.join(self.capabilities.device_types)} "
                f"tensors, not {device.type}"
            )
        return None

    def supports(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor | None = None,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        return_lse: bool = False,
        tree_mask: bool = False,
    ) -> str | None:
        """``None`` if this backend can run attention on these inputs, else the reason.

        Only declared capabilities are checked here (dtype, head size, block
        size, device, features); malformed inputs are the ops' own
        ``ValueError``\\ s.
        """
        caps = self.capabilities
        if query.dtype not in caps.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in caps.dtypes)
            return f"backend {self.name!r} does not support dtype {query.dtype} (supported: {names})"
        head_size = query.shape[-1]
        if caps.max_head_size is not None and head_size > caps.max_head_size:
            return f"backend {self.name!r} supports head sizes up to {caps.max_head_size}, got {head_size}"
        if key_cache is not None:
            if key_cache.dtype != query.dtype:
                reason = self.kv_cache_dtype_problem(key_cache.dtype)
                if reason is not None:
                    return reason if reason else f"key_cache dtype {key_cache.dtype} differs from query dtype {query.dtype}"
            if key_cache.dim() == 4:
                block_size = key_cache.shape[1]
                low, high = caps.block_sizes
                if block_size < low or (high is not None and block_size > high):
                    return f"backend {self.name!r} supports block sizes {low}..{high or 'any'}, got {block_size}"
        wanted = {"sliding_window": sliding_window is not None, "softcap": softcap is not None,
                  "return_lse": bool(return_lse), "tree": tree_mask is not None and tree_mask is not False}
        for feature, asked in wanted.items():
            if asked and feature not in caps.features:
                return f"backend {self.name!r} does not implement {feature}"
        return self.device_problem(query.device)

    def kv_cache_dtype_problem(self, cache_dtype: torch.dtype) -> str | None:
        """Why this backend cannot read pages stored as ``cache_dtype`` (a quantized format's
        storage dtype), ``None`` if it can, ``""`` if ``cache_dtype`` is no KV format at all."""
        from servelab.blocks.kv_quant import format_of_dtype

        fmt = format_of_dtype(cache_dtype)
        if fmt is None:
            return ""
        supported = self.capabilities.supported_kv_cache_dtypes
        if "any" in supported or fmt.name in supported:
            return None
        return (f"backend {self.name!r} cannot read kv_cache_dtype={fmt.name!r} pages ({cache_dtype}); "
                f"it reads kv_cache_dtype {', '.join(map(repr, supported))}")

    def _refuse_unsupported(self, query: torch.Tensor, key_cache: torch.Tensor | None, **features: Any) -> None:
        reason = self.supports(query, key_cache, **features)
        if reason is not None:
            raise UnsupportedInputError(reason)

    # ---- public ops: capability gate, then the implementation --------------

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
             block_size: int, causal: bool = True, sliding_window: int | None = None,
             **chaining: Any) -> Any | None:
        """Work shared by every layer of one step (index tensors, masks), or ``None``.

        The model calls it once per forward (per distinct sliding window) and
        passes the result as ``paged_attention(..., plan=...)`` to every layer.
        The default plans nothing; a backend that returns a plan must accept it.

        A backend declaring the ``"plan_chaining"`` feature is also called
        with ``chain=True`` and ``previous=`` its own plan from the model's
        previous forward over the same caches (``None`` when there was none,
        it failed, or any cache tensor was modified in place since), and may
        carry work from it (the ``"sdpa"`` backend carries decode K/V:
        :mod:`servelab.attention.decode_kv`). A plan may then hold state
        that is only valid for the next forward of the same model.

        A step verifying token trees passes ``tree_mask=`` (a
        :class:`~servelab.attention.TreeMask`) to backends declaring ``"tree"``.
        """
        return None

    def paged_attention(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
        scale: float | None = None, causal: bool = True, sliding_window: int | None = None,
        softcap: float | None = None, out: torch.Tensor | None = None, num_splits: int | None = None,
        return_lse: bool = False, check_inputs: bool = True, plan: Any | None = None,
        tree_mask: Any | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of a mixed batch over the paged cache: ``[T, Hq, D]`` in the
        query's dtype, or ``(out, lse float32 [T, Hq])`` with ``return_lse``.

        Semantics of every argument as :func:`servelab.reference.paged_attention`
        (row ``t`` of sequence ``i`` sits at position ``seq_len - query_len + t``
        and sees keys ``j <= p``, ``p - j < sliding_window``; scores times
        ``scale``, default ``D ** -0.5``); ``plan`` is this backend's
        :meth:`plan` for the same metadata (made with the same ``tree_mask``);
        ``tree_mask`` a :class:`~servelab.attention.TreeMask` or None (backends
        declaring the ``"tree"`` feature).
        """
        if isinstance(query, torch.Tensor) and isinstance(key_cache, torch.Tensor):
            self._refuse_unsupported(query, key_cache, sliding_window=sliding_window, softcap=softcap,
                                     return_lse=return_lse, tree_mask=tree_mask is not None)
        kwargs: dict[str, Any] = dict(scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap,
                                      out=out, num_splits=num_splits, return_lse=return_lse,
                                      check_inputs=check_inputs)
        if plan is not None:
            kwargs["plan"] = plan
        if tree_mask is not None:
            kwargs["tree_mask"] = tree_mask
        if k_scale is not None or v_scale is not None:  # a quantized cache (servelab.blocks.kv_quant)
            kwargs.update(k_scale=k_scale, v_scale=v_scale)
        return self._paged_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, **kwargs)

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                          check_inputs: bool = True, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> None:
        """Write ``key`` / ``value`` ``[T, Hk, D]`` into the caches at ``slot_mapping``
        ``[n <= T]`` (slot ``s`` = block ``s // B``, offset ``s % B``; ``-1`` skips),
        in place. ``check_inputs`` reads the slots (range, no slot twice). A quantized
        cache comes with its ``k_scale`` / ``v_scale`` (rows quantized as written)."""
        if isinstance(key, torch.Tensor) and isinstance(key_cache, torch.Tensor):
            self._refuse_unsupported(key, key_cache)
        extra = {} if k_scale is None and v_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        return self._reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_inputs=check_inputs,
                                       **extra)

    def merge_attn_states(self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                          lse_b: torch.Tensor, *, out: torch.Tensor | None = None,
                          check_inputs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge two partial attentions ``[T, H, D]`` over disjoint keys by their
        float32 LSEs ``[T, H]`` (``-inf`` = empty); returns ``(out, lse)``."""
        if isinstance(out_a, torch.Tensor):
            self._refuse_unsupported(out_a, None)
        return self._merge_attn_states(out_a, lse_a, out_b, lse_b, out=out, check_inputs=check_inputs)

    # ---- implementations ---------------------------------------------------

    @abstractmethod
    def _paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The backend's attention; ``kwargs`` as :meth:`paged_attention`'s (``plan`` only if planned,
        ``tree_mask`` only when there is one)."""

    def _reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping, **kwargs) -> None:
        from servelab.attention.ops import reshape_and_cache

        return reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, **kwargs)

    def _merge_attn_states(self, out_a, lse_a, out_b, lse_b, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        from servelab.attention.ops import merge_attn_states

        return merge_attn_states(out_a, lse_a, out_b, lse_b, **kwargs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


ALL_FEATURES = frozenset({"causal", "sliding_window", "softcap", "gqa", "return_lse", "tree"})
ANY_DEVICE = ("cpu", "cuda", "mps", "xpu")
ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class SdpaAttentionBackend(AttentionBackend):
    """Paged attention as batched ``scaled_dot_product_attention`` calls
    (:mod:`servelab.attention.sdpa`): the fast choice on a CPU. Plans once
    per step (gather indices, additive masks, decode / prefill groups) and
    chains plans: consecutive decode steps of the same sequences carry their
    K/V instead of gathering it again (:mod:`servelab.attention.decode_kv`).
    No softcap, no LSE."""

    name = "sdpa"
    capabilities = AttentionCapabilities(
        dtypes=ALL_DTYPES, device_types=ANY_DEVICE, supported_kv_cache_dtypes=("auto", "any"),
        features=frozenset({"causal", "sliding_window", "gqa", "plan_chaining", "tree"}))

    def plan(self, block_table, seq_lens, query_start_loc, *, block_size, causal=True, sliding_window=None,
             chain=False, previous=None, tree_mask=None):
        from servelab.attention.sdpa import plan_attention

        return plan_attention(block_table, seq_lens, query_start_loc, block_size=block_size, causal=causal,
                              sliding_window=sliding_window, chain=chain, previous=previous, tree_mask=tree_mask)

    def _paged_attention(self, *args, **kwargs):
        from servelab.attention.sdpa import paged_attention

        return paged_attention(*args, **kwargs)

    def prepare(self, query: torch.Tensor, key_cache: torch.Tensor) -> None:
        """Called once when a pipeline is built (``query`` ``[1, Hq, D]``, ``key_cache`` the
        pool's): builds and loads the C decode kernel now when the decode path may use it, so
        that the first decode step is not a compile (:mod:`servelab.attention.cpu_decode`)."""
        group = query.shape[1] // max(key_cache.shape[-2], 1)
        if query.device.type == "cpu" and query.dtype in (torch.float32, torch.float16, torch.bfloat16):
            cpu_decode.supports(torch.float32, query.shape[-1], group, query.device)  # float32 compute


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels of :mod:`servelab.kernels` (CUDA, or CPU under the interpreter)."""

    name = "triton"
    capabilities = AttentionCapabilities(
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        supported_kv_cache_dtypes=("auto", "int8", "fp8_e4m3", "fp8_e5m2"),
        max_head_size=256,
        device_types=("cpu", "cuda"),
        features=ALL_FEATURES | {"split_kv"},
    )

    def device_problem(self, device: torch.device) -> str | None:
        # Once the kernels are imported their mode is fixed; trust it over the
        # environment, which may have changed since.
        kernels = sys.modules.get("servelab.kernels.paged_attention")
        interpreted = getattr(kernels, "INTERPRETED", None)
        return triton_device_problem(device, interpreted=interpreted)

    @staticmethod
    def _kernel(module: str, name: str) -> Callable[..., Any]:
        return getattr(importlib.import_module(f"servelab.kernels.{module}"), name)

    def _paged_attention(self, *args, **kwargs):
        return self._kernel("paged_attention", "paged_attention")(*args, **kwargs)

    def _reshape_and_cache(self, *args, **kwargs):
        return self._kernel("reshape_and_cache", "reshape_and_cache")(*args, **kwargs)

    def _merge_attn_states(self, *args, **kwargs):
        return self._kernel("merge_attn_states", "merge_attn_states")(*args, **kwargs)


# ---- registry --------------------------------------------------------------

_OPS = ("paged_attention", "reshape_and_cache")


def _check_backend(obj: Any) -> None:
    missing = [op for op in _OPS if not callable(getattr(obj, op, None))]
    if missing:
        raise TypeError(f"an attention backend needs callable {', '.join(_OPS)}; "
                        f"{type(obj).__name__} lacks {', '.join(missing)}")


_REGISTRY: Registry[AttentionBackend] = Registry("attention backend", factory=True, check=_check_backend)
_REGISTRY.register("sdpa", SdpaAttentionBackend)
_REGISTRY.register("torch", "servelab.reference.attention_backend:TorchAttentionBackend")
_REGISTRY.register("triton", TritonAttentionBackend)


class _Same:
    """Factory returning one registered instance (an instance registered by name)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def __call__(self) -> Any:
        return self.backend


def register_attention_backend(name: str, backend: Any, *, override: bool = False) -> None:
    """Make ``get_attention_backend(name)`` return ``backend``.

    Args:
        name: non-empty string without surrounding spaces (else ``ValueError``).
        backend: an :class:`AttentionBackend` subclass or zero-argument factory
            (called on every lookup), an instance (returned as is), or a lazy
            ``"package.module:attribute"`` string naming a class or factory.
        override: replace an existing name; without it a duplicate raises ``ValueError``.

    Raises:
        TypeError: ``backend`` is none of the above (an instance without
            callable ``paged_attention`` and ``reshape_and_cache``).
    """
    if isinstance(backend, str):
        if ":" not in backend:
            raise TypeError(f"backend={backend!r}: a string backend must be a lazy 'package.module:attribute'")
    elif not callable(backend) or isinstance(backend, AttentionBackend):
        _check_backend(backend)
        backend = _Same(backend)
    _REGISTRY.register(name, backend, override=override)


def available_attention_backends() -> list[str]:
    """Registered backend names (``"sdpa"``, ``"torch"``, ``"triton"`` and any
    registered since), whether or not they can run on this machine."""
    return _REGISTRY.available()


def get_attention_backend(name_or_obj: Any) -> AttentionBackend:
    """The backend registered as ``name_or_obj`` (a fresh instance for a class),
    or ``name_or_obj`` itself when it is an object with the ops.

    ``"auto"`` gives :func:`default_attention_backend` for the CPU. Raises
    ``ValueError`` listing the valid names for an unknown one, ``TypeError``
    for an object without the ops. Getting a backend never fails for lack of
    a GPU: ask ``backend.supports(...)``.
    """
    if name_or_obj == "auto" and isinstance(name_or_obj, str) and "auto" not in _REGISTRY:
        name_or_obj = default_attention_backend("cpu")
    backend = _REGISTRY.get(name_or_obj)
    if isinstance(name_or_obj, str):
        _check_backend(backend)
    return backend


def default_attention_backend(device: torch.device | str = "cpu", *, query: torch.Tensor | None = None,
                              key_cache: torch.Tensor | None = None, sliding_window: int | None = None,
                              softcap: float | None = None) -> str:
    """The one ``"auto"`` rule: ``"triton"`` where its kernels can launch natively
    (CUDA with Triton installed), else ``"sdpa"``; and, given a probe of the model
    (``query`` ``[1, H, D]`` and ``key_cache`` ``[1, block_size, Hkv, D]`` in its
    dtype, its window and soft-cap), ``"torch"`` (the references, which run
    everything) when that backend's ``supports()`` refuses the model."""
    device = torch.device(device)
    name = "sdpa"
    if device.type == "cuda" and triton_device_problem(device, interpreted=False) is None:
        name = "triton"
    if query is None or key_cache is None:
        return name
    reason = get_attention_backend(name).supports(query, key_cache, sliding_window=sliding_window, softcap=softcap)
    return name if reason is None else "torch"
