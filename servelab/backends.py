"""Attention backend registry: pick the Triton kernels or the PyTorch references by name.

>>> backend = get_attention_backend("torch")
>>> reason = backend.supports(query, key_cache)   # None, or why it can't
>>> out = backend.paged_attention(query, key_cache, value_cache, block_table,
...                               seq_lens, query_start_loc)

Every backend exposes the same three ops with the signatures of
:mod:`servelab.reference` (``paged_attention``, ``reshape_and_cache``,
``merge_attn_states``) and declares what it supports in
:class:`AttentionCapabilities`. ``supports(...)`` returns ``None`` when the
backend can take the input and otherwise a sentence saying why not; the ops
raise :class:`UnsupportedInputError` with that sentence rather than falling
back to another backend. Researchers add their own with
:func:`register_attention_backend`.

This module never imports Triton at import time (Triton is Linux-only): the
Triton backend imports :mod:`servelab.kernels` on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "AttentionBackend",
    "AttentionCapabilities",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
    "UnsupportedInputError",
    "available_attention_backends",
    "get_attention_backend",
    "register_attention_backend",
    "triton_device_problem",
]


class UnsupportedInputError(ValueError):
    """A backend was asked to run on an input it declared it cannot take."""


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend can take. ``None`` limits mean "no limit".

    Attributes:
        dtypes: query / KV-cache dtypes accepted.
        max_head_size: largest head size (any size up to it, powers of two or not).
        block_sizes: accepted KV-cache block sizes as an inclusive ``(min, max)``.
        device_types: torch device types the ops run on (further narrowed at run
            time by :meth:`AttentionBackend.device_problem`).
        features: optional features implemented, e.g. ``"sliding_window"``,
            ``"softcap"``, ``"split_kv"``, ``"return_lse"``.
    """

    dtypes: tuple[torch.dtype, ...]
    max_head_size: int | None
    block_sizes: tuple[int, int | None]
    device_types: tuple[str, ...]
    features: frozenset[str] = field(default_factory=frozenset)


class AttentionBackend:
    """Base class: a named set of attention ops plus a capability declaration.

    Subclasses set ``name`` and ``capabilities`` and implement the three ops
    ``_paged_attention``, ``_reshape_and_cache`` and ``_merge_attn_states``
    (same signatures as :mod:`servelab.reference`); the public methods check
    :meth:`supports` first and refuse unsupported inputs with the reason.
    """

    name: str = ""
    capabilities: AttentionCapabilities

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
            return (
                f"backend {self.name!r} supports head sizes up to {caps.max_head_size}, "
                f"got {head_size}"
            )
        if key_cache is not None:
            if key_cache.dtype != query.dtype:
                return f"key_cache dtype {key_cache.dtype} differs from query dtype {query.dtype}"
            if key_cache.dim() == 4:
                block_size = key_cache.shape[1]
                low, high = caps.block_sizes
                if block_size < low or (high is not None and block_size > high):
                    return (
                        f"backend {self.name!r} supports block sizes {low}..{high or 'any'}, "
                        f"got {block_size}"
                    )
        for feature, wanted in (("sliding_window", sliding_window), ("softcap", softcap)):
            if wanted is not None and feature not in caps.features:
                return f"backend {self.name!r} does not implement {feature}"
        return self.device_problem(query.device)

    def _refuse_unsupported(self, query: torch.Tensor, key_cache: torch.Tensor | None, **features: Any) -> None:
        reason = self.supports(query, key_cache, **features)
        if reason is not None:
            raise UnsupportedInputError(reason)

    # Public ops: capability gate, then the implementation.
    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """See :func:`servelab.reference.paged_attention` (same arguments and keywords)."""
        if isinstance(query, torch.Tensor) and isinstance(key_cache, torch.Tensor):
            self._refuse_unsupported(
                query, key_cache,
                sliding_window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"),
            )
        return self._paged_attention(
            query, key_cache, value_cache, block_table, seq_lens, query_start_loc, **kwargs
        )

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        """See :func:`servelab.reference.reshape_and_cache`."""
        if isinstance(key, torch.Tensor) and isinstance(key_cache, torch.Tensor):
            self._refuse_unsupported(key, key_cache)
        return self._reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, **kwargs)

    def merge_attn_states(
        self,
        out_a: torch.Tensor,
        lse_a: torch.Tensor,
        out_b: torch.Tensor,
        lse_b: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`servelab.reference.merge_attn_states`."""
        if isinstance(out_a, torch.Tensor):
            self._refuse_unsupported(out_a, None)
        return self._merge_attn_states(out_a, lse_a, out_b, lse_b, **kwargs)

    def _paged_attention(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def _reshape_and_cache(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def _merge_attn_states(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


_ALL_FEATURES = frozenset({"causal", "sliding_window", "softcap", "gqa", "return_lse"})


class TorchAttentionBackend(AttentionBackend):
    """The PyTorch references: any device torch runs on, float64 included, any head size."""

    name = "torch"
    capabilities = AttentionCapabilities(
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
        max_head_size=None,
        block_sizes=(1, None),
        device_types=("cpu", "cuda", "mps", "xpu"),
        features=_ALL_FEATURES,
    )

    def _paged_attention(self, *args, **kwargs):
        from servelab.reference.paged_attention import paged_attention

        return paged_attention(*args, **kwargs)

    def _reshape_and_cache(self, *args, **kwargs):
        from servelab.reference.reshape_and_cache import reshape_and_cache

        return reshape_and_cache(*args, **kwargs)

    def _merge_attn_states(self, *args, **kwargs):
        from servelab.reference.merge_attn_states import merge_attn_states

        return merge_attn_states(*args, **kwargs)


class SdpaAttentionBackend(TorchAttentionBackend):
    """Paged attention as one batched ``scaled_dot_product_attention`` call
    (:mod:`servelab.sdpa_attention`): the fast choice on a CPU. The cache write
    and state merge are the references'. No softcap, no LSE."""

    name = "sdpa"
    capabilities = AttentionCapabilities(
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
        max_head_size=None,
        block_sizes=(1, None),
        device_types=("cpu", "cuda", "mps", "xpu"),
        features=frozenset({"causal", "sliding_window", "gqa"}),
    )

    def _paged_attention(self, *args, **kwargs):
        if kwargs.get("return_lse"):
            raise UnsupportedInputError(f"backend {self.name!r} does not implement return_lse")
        from servelab.sdpa_attention import paged_attention

        return paged_attention(*args, **kwargs)


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked entry in sys.modules
        return False


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def triton_device_problem(device: torch.device | str, interpreted: bool | None = None) -> str | None:
    """Why a Triton kernel cannot launch on ``device``, or ``None`` if it can.

    ``interpreted`` says whether the kernels were built under
    ``TRITON_INTERPRET=1`` (Triton decides when a kernel is decorated); when
    ``None`` the current environment variable is used.
    """
    if not _triton_installed():
        return "Triton is not installed (it is published for Linux only); use the 'torch' backend"
    device = torch.device(device)
    if interpreted is None:
        interpreted = _interpret_env()
    if device.type == "cpu":
        if not interpreted:
            return (
                "0 active drivers: Triton finds no GPU driver and TRITON_INTERPRET is not "
                "set, so it cannot launch on CPU tensors (export TRITON_INTERPRET=1 before "
                "importing servelab.kernels, or use the 'torch' backend)"
            )
        return None
    if device.type == "cuda":
        if interpreted:
            return (
                "the kernels were built for the CPU interpreter (TRITON_INTERPRET=1); "
                "unset it to run them on the GPU"
            )
        if not torch.cuda.is_available():
            return "CUDA is not available to this torch build or machine"
        return None
    return f"Triton kernels run on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), not on {device.type}"


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels of :mod:`servelab.kernels` (CUDA, or CPU under the interpreter)."""

    name = "triton"
    capabilities = AttentionCapabilities(
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        max_head_size=256,
        block_sizes=(1, None),
        device_types=("cpu", "cuda"),
        features=_ALL_FEATURES | {"split_kv"},
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


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {
    "triton": TritonAttentionBackend,
    "torch": TorchAttentionBackend,
    "sdpa": SdpaAttentionBackend,
}


def register_attention_backend(
    name: str, factory: Callable[[], AttentionBackend], *, replace: bool = False
) -> None:
    """Make ``get_attention_backend(name)`` return ``factory()``.

    ``factory`` is usually an :class:`AttentionBackend` subclass. Registering
    an existing name raises ``ValueError`` unless ``replace=True``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable (e.g. an AttentionBackend subclass), got {factory!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"attention backend {name!r} is already registered; pass replace=True")
    _REGISTRY[name] = factory


def available_attention_backends() -> list[str]:
    """Registered backend names (whether or not they can run on this machine)."""
    return sorted(_REGISTRY)


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend registered as ``name`` (``"triton"`` or ``"torch"`` built in).

    Raises ``ValueError`` listing the valid names for an unknown one. Getting a
    backend never fails for lack of a GPU: ask ``backend.supports(...)``.
    """
    try:
        factory = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown attention backend {name!r}; valid names: {', '.join(available_attention_backends())}"
        ) from None
    return factory()
