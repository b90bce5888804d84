"""Sampling backends: which implementation runs the sampling and rejection ops.

One registry, the same dispatch style as attention backends: a backend is an
object with the ops as methods and a way to say where it cannot run.

- ``"torch"``: the PyTorch references (:mod:`servelab.reference.sampling`,
  :mod:`servelab.reference.rejection_sample`); runs anywhere.
- ``"triton"``: the kernels (:mod:`servelab.kernels`); needs CUDA tensors, or
  CPU tensors with ``TRITON_INTERPRET=1`` set before the kernels were imported.
- ``"auto"`` is a rule, not a backend: Triton for CUDA tensors when it can
  launch there, the reference otherwise (CPU tensors, or no usable Triton).

Asking for a backend where it cannot run raises ``ValueError`` with the
reason (from :func:`servelab.attention.backends.triton_device_problem` for
Triton); nothing falls back silently. Every op is imported on first use, so
``servelab.samplers`` imports without Triton.

A backend of your own: any object with ``name``, ``top_k_top_p_sample(...)``
and ``rejection_sample(...)`` (the signatures of the references) and
optionally ``unavailable_reason(device) -> str | None``; register it with
:func:`register_sampling_backend` or pass it to ``Sampler(backend=...)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from servelab._internal.registry import Registry
from servelab.attention.backends import triton_device_problem

__all__ = [
    "LazySamplingBackend",
    "SamplingBackend",
    "available_sampling_backends",
    "check_backend_name",
    "get_sampling_backend",
    "register_sampling_backend",
    "resolve_backend",
    "triton_unavailable_reason",
]

AUTO = "auto"


@runtime_checkable
class SamplingBackend(Protocol):
    """The ops a sampling backend provides (signatures of :mod:`servelab.reference`).

    ``top_k_top_p_sample(logits, top_k, top_p, min_p, exponential_noise, *,
    check_inputs=True) -> int64 [R]`` and ``rejection_sample(draft_token_ids,
    num_draft_tokens, target_probs, draft_probs=None, *, greedy=False,
    generator=None, check_inputs=True) -> int64 [num_reqs, max k + 1]``.
    """

    name: str

    def top_k_top_p_sample(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...

    def rejection_sample(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...


class LazySamplingBackend:
    """A backend whose ops are ``"module:function"`` strings imported on first call.

    ``device_problem(device) -> str | None`` says why it cannot run on a device.
    """

    def __init__(self, name: str, *, top_k_top_p_sample: str, rejection_sample: str,
                 device_problem: Callable[[torch.device], str | None] | None = None) -> None:
        self.name = name
        self._paths = {"top_k_top_p_sample": top_k_top_p_sample, "rejection_sample": rejection_sample}
        self._ops: dict[str, Callable[..., torch.Tensor]] = {}
        self._device_problem = device_problem

    def __repr__(self) -> str:
        return f"LazySamplingBackend({self.name!r})"

    def op(self, name: str) -> Callable[..., torch.Tensor]:
        """The function implementing op ``name`` (imported once)."""
        if name not in self._ops:
            module, _, attr = self._paths[name].partition(":")
            self._ops[name] = getattr(importlib.import_module(module), attr)
        return self._ops[name]

    def unavailable_reason(self, device: torch.device | str) -> str | None:
        return None if self._device_problem is None else self._device_problem(torch.device(device))

    def top_k_top_p_sample(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.op("top_k_top_p_sample")(*args, **kwargs)

    def rejection_sample(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.op("rejection_sample")(*args, **kwargs)


def _check_backend(obj: object) -> None:
    missing = [op for op in ("top_k_top_p_sample", "rejection_sample") if not callable(getattr(obj, op, None))]
    if missing:
        raise TypeError(f"sampling backend {type(obj).__name__} lacks {', '.join(missing)} "
                        "(the ops of servelab.reference.sampling / rejection_sample)")


_BACKENDS: Registry[Any] = Registry("sampling backend", check=_check_backend)
_BACKENDS.register("torch", LazySamplingBackend(
    "torch",
    top_k_top_p_sample="servelab.reference.sampling:top_k_top_p_sample",
    rejection_sample="servelab.reference.rejection_sample:rejection_sample",
))
_BACKENDS.register("triton", LazySamplingBackend(
    "triton",
    top_k_top_p_sample="servelab.kernels.sampling:top_k_top_p_sample",
    rejection_sample="servelab.kernels.rejection_sample:rejection_sample",
    device_problem=triton_device_problem,
))


def register_sampling_backend(name: str, obj: Any, *, override: bool = False) -> None:
    """Register a backend object (see the module docstring); ``"auto"`` is reserved."""
    if name == AUTO:
        raise ValueError("sampling backend name 'auto' is reserved for the automatic choice")
    _BACKENDS.register(name, obj, override=override)


def available_sampling_backends() -> list[str]:
    """``"auto"`` and the registered backend names, sorted."""
    return sorted([AUTO, *_BACKENDS.available()])


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton sampling kernels cannot take tensors on ``device`` (None if they can)."""
    return triton_device_problem(torch.device(device))


def check_backend_name(backend: object) -> str | object:
    """``backend`` if it is ``"auto"``, a registered name or a backend object; else ``ValueError`` / ``TypeError``."""
    if isinstance(backend, str):
        if backend != AUTO and backend not in _BACKENDS:
            known = ", ".join(repr(name) for name in available_sampling_backends())
            raise ValueError(f"unknown sampling backend {backend!r}; known: {known}")
        return backend
    _check_backend(backend)
    return backend


def _reason(backend: Any, device: torch.device) -> str | None:
    reason_of = getattr(backend, "unavailable_reason", None)
    return None if reason_of is None else reason_of(device)


def get_sampling_backend(name_or_obj: str | Any, device: torch.device | str | None = None) -> Any:
    """The backend for a name (``"auto"`` resolved for ``device``, default CPU) or an object.

    With ``device`` given, a backend that cannot run there raises
    ``ValueError`` with the reason.
    """
    if isinstance(name_or_obj, str):
        check_backend_name(name_or_obj)
    if name_or_obj == AUTO:
        return _BACKENDS.get(resolve_backend(AUTO, device if device is not None else "cpu"))
    backend = _BACKENDS.get(name_or_obj)
    if device is not None:
        reason = _reason(backend, torch.device(device))
        if reason is not None:
            name = getattr(backend, "name", type(backend).__name__)
            raise ValueError(f"backend={name!r} cannot run on {torch.device(device)}: {reason}")
    return backend


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The registered name ``backend`` means for tensors on ``device``; raise if it cannot run there."""
    check_backend_name(backend)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a name here, got {type(backend).__name__}")
    device = torch.device(device)
    if backend == AUTO:
        use_triton = device.type == "cuda" and triton_device_problem(device) is None
        return "triton" if use_triton else "torch"
    get_sampling_backend(backend, device)
    return backend
