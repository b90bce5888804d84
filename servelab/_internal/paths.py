"""Where servelab keeps files it builds or fetches: one cache root for every layer.

Checkpoints (``servelab.models.hub``) and compiled kernels
(``servelab.attention.cpu_decode``) both live under :func:`cache_root`; the
function sits here, below both, so neither layer imports the other for it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SERVELAB_CACHE"


def cache_root() -> Path:
    """``$SERVELAB_CACHE``, else ``$XDG_CACHE_HOME/servelab``, else ``~/.cache/servelab``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "servelab"
