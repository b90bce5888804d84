"""The cached tiny checkpoint (``servelab demo``'s default model): staged, renamed, checked.

:func:`servelab.models.build_tiny_model` writes a folder in place, file by
file; a cache cannot be written that way, because an interrupt during the
weight write would leave a folder with ``config.json`` and no (or half a)
``model.safetensors`` that every later run would trust and fail on.

:func:`cached_tiny_model` therefore builds the checkpoint in a temporary
sibling folder, writes a completion marker last (the size of every file it
holds), and renames the folder into place in one ``os.replace``. A folder
whose marker is missing, or whose files do not have the marker's sizes
(a truncated or deleted file), is *damaged*: it is removed and rebuilt, and
the caller gets a message saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from servelab.models.tiny import build_tiny_model

__all__ = ["COMPLETE_MARKER", "cached_tiny_model", "tiny_cache_problem"]

COMPLETE_MARKER = ".servelab-complete"
"""Written last into a complete cached folder: a JSON object ``{file name: size in bytes}``."""


def tiny_cache_problem(folder: str | os.PathLike) -> str | None:
    """Why the cached folder is not usable (``None`` when it is complete and intact)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "missing" if not folder.exists() else "not a folder"
    marker = folder / COMPLETE_MARKER
    if not marker.is_file():
        return "no completion marker: an interrupted build"
    try:
        sizes = json.loads(marker.read_text())
    except (OSError, ValueError):
        return "an unreadable completion marker"
    if not isinstance(sizes, dict) or not any(str(name).endswith(".safetensors") for name in sizes):
        return "a completion marker that lists no weights"
    for name, size in sizes.items():
        file = folder / str(name)
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def cached_tiny_model(path: str | os.PathLike, arch: str = "llama", seed: int = 0,
                      **build_kwargs: Any) -> tuple[Path, str | None]:
    """The tiny checkpoint folder at ``path``, built once (staged and renamed); rebuilt when damaged.

    Returns ``(folder, message)``: ``message`` is ``None`` when the folder
    was reused or built fresh, else a sentence saying what was damaged and
    that it was rebuilt. ``arch``, ``seed`` and ``build_kwargs`` go to
    :func:`~servelab.models.build_tiny_model` (a cached folder is not
    checked against them: one cache path per configuration).

    Raises ``ValueError`` when ``path`` is an existing file.
    """
    folder = Path(path)
    problem = tiny_cache_problem(folder)
    if problem is None:
        return folder, None
    if problem == "not a folder":
        raise ValueError(f"tiny model cache {str(folder)!r} is a file, not a folder; remove it or give another path")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{folder.name}-", dir=folder.parent) as tmp:
        staged = build_tiny_model(Path(tmp) / "model", arch, seed, **build_kwargs)
        sizes = {f.name: f.stat().st_size for f in sorted(staged.iterdir()) if f.is_file()}
        (staged / COMPLETE_MARKER).write_text(json.dumps(sizes, sort_keys=True) + "\n")
        if tiny_cache_problem(folder) is None:  # another process finished first
            return folder, None
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staged, folder)
    if problem == "missing":
        return folder, None
    return folder, f"the cached tiny model in {folder} was damaged ({problem}); rebuilt it"
