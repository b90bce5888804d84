"""The ``vllm.general_plugins`` entry point: inert until the user opts in.

vLLM calls every installed general plugin in every process it starts
(workers included), so installing servelab must not change a vLLM process
that did not ask for it. :func:`load` therefore does nothing unless
``SERVELAB_VLLM_ATTENTION=1`` is set; this module imports nothing from vLLM
or from :mod:`servelab.integrations.vllm` at load, never touches the
environment, and never raises into vLLM's plugin loader (an unsupported vLLM
version or a failed registration is one warning, and nothing is registered).

Opt in either way:

- ``SERVELAB_VLLM_ATTENTION=1 vllm serve ...``: every vLLM process registers
  servelab's Triton paged attention as vLLM's ``CUSTOM`` attention backend;
- or call :func:`servelab.integrations.vllm.register_attention_backend`
  yourself (one process; ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings

__all__ = ["OPT_IN_ENV", "load"]

OPT_IN_ENV = "SERVELAB_VLLM_ATTENTION"
"""Set to ``1`` to let the plugin register servelab's attention backend in every vLLM process."""

_warned = False


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def load() -> str | None:
    """The entry point vLLM calls (no arguments). Returns the backend name it
    registered, or None when it did nothing (not opted in, unsupported vLLM
    version, registration failed: the last two with one warning)."""
    if os.environ.get(OPT_IN_ENV, "").strip() != "1":
        return None
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    try:
        from servelab.integrations.vllm._compat import check_version

        check_version(version)
        from servelab.integrations.vllm.attention import register

        return register()
    except Exception as exc:  # never raise inside vLLM's plugin loader
        _warn_once(f"servelab's vLLM attention plugin ({OPT_IN_ENV}=1) did nothing: {type(exc).__name__}: {exc}")
        return None
