"""Is a supported vLLM importable? One check, one message.

Supported: vLLM 0.33.x (the interfaces bridged here — ``Scheduler``'s
``waiting`` queue, ``_preempt_request``, ``_update_after_schedule``,
``_free_request``, the v1 ``LogitsProcessor`` / ``BatchUpdate`` API, the
attention backend registry — are not public and change between minor
releases, so other versions are refused rather than half-working). Set
``SERVELAB_VLLM_ALLOW_UNSUPPORTED=1`` to try another version at your own risk.
"""

from __future__ import annotations

import os
import sys
import warnings

SUPPORTED_VLLM = ("0.33",)
"""Minor versions the bridges are written and tested against (0.33.0 in CI)."""

INSTALL_HINT = (
    'install it with `pip install "servelab[vllm]"` on a machine with a CUDA GPU, or, on a CPU-only '
    "machine, build the CPU environment from this repository: `bash ci/vllm-cpu/setup.sh VENV_DIR` "
    "(torch's CPU wheel, then vLLM and its pinned dependencies with --no-deps)"
)


class UnsupportedVLLMVersion(ImportError):
    """vLLM imports but is a version the bridges were not written for."""


def check_version(version: str) -> None:
    """Raise :class:`UnsupportedVLLMVersion` unless ``version`` is a supported minor release."""
    minor = ".".join(str(version).split("+")[0].split(".")[:2])
    if minor in SUPPORTED_VLLM:
        return
    message = (f"servelab.integrations.vllm supports vLLM {', '.join(v + '.x' for v in SUPPORTED_VLLM)}; "
               f"vLLM {version} is installed. The scheduler, logits-processor and attention interfaces it "
               "bridges are internal to vLLM and change between minor versions; install a supported version "
               "(`pip install vllm==0.33.*`) or set SERVELAB_VLLM_ALLOW_UNSUPPORTED=1 to try anyway")
    if os.environ.get("SERVELAB_VLLM_ALLOW_UNSUPPORTED") == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return
    raise UnsupportedVLLMVersion(message)


def require_vllm() -> str:
    """Import vLLM and check its version; returns it. ``ImportError`` with the
    install recipe when vLLM is missing, :class:`UnsupportedVLLMVersion` when
    it is the wrong version. Without CUDA, sets ``VLLM_TARGET_DEVICE=cpu``
    (unless already set) before vLLM is first imported; once vLLM is imported
    (inside a vLLM process, or a plugin) the environment is left alone."""
    if "VLLM_TARGET_DEVICE" not in os.environ and "vllm" not in sys.modules:
        # vLLM's CPU-side classes (scheduler, KV cache manager) need the CPU platform on a machine
        # without CUDA; with CUDA, vLLM detects the platform itself.
        import torch

        if not torch.cuda.is_available():
            os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"servelab.integrations.vllm needs vLLM, which is not importable ({exc}); "
                          f"{INSTALL_HINT}") from exc
    version = getattr(vllm, "__version__", "unknown")
    check_version(version)
    return version
