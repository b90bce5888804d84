"""Where servelab keeps files it builds or fetches: one cache root for every layer.

Checkpoints (``servelab.models.hub``) and compiled kernels
(``servelab.attention.cpu_decode``) both live under :func:`cache_root`; the
function sits here, below both, so neither layer imports the other for it.
Compiled kernels may be put elsewhere with ``$SERVELAB_KERNEL_CACHE``
(:func:`kernel_cache_dir`; the test suite points it at a temporary folder so
that tests never write into the user's cache, yet still find fetched checkpoints).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SERVELAB_CACHE"
KERNEL_CACHE_ENV = "SERVELAB_KERNEL_CACHE"


def cache_root() -> Path:
    """``$SERVELAB_CACHE``, else ``$XDG_CACHE_HOME/servelab``, else ``~/.cache/servelab``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "servelab"


def kernel_cache_dir() -> Path:
    """``$SERVELAB_KERNEL_CACHE``, else ``<cache_root()>/kernels``: where compiled kernels live."""
    if os.environ.get(KERNEL_CACHE_ENV):
        return Path(os.environ[KERNEL_CACHE_ENV]).expanduser()
    return cache_root() / "kernels"
