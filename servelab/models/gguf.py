"""GGUF checkpoints in: a ``.gguf`` file loads like a HF checkpoint folder.

GGUF (llama.cpp's single-file format) is what most people who run small
models locally have on disk. servelab reads it through ``transformers``' GGUF
reader, which needs the ``gguf`` and ``accelerate`` packages
(``pip install "servelab[gguf]"``): it maps llama.cpp's tensor names
(``blk.N.attn_q.weight``...) to HF names, undoes llama.cpp's rotary
permutation of the Llama q/k projections, and *dequantizes* every tensor to
float32. The model servelab then runs is the dequantized one: a ``Q4_1`` file
gives the weights ``Q4_1`` rounding produced, computed in float32 (or the
``dtype`` asked for), not int4 kernels.

What is accepted, checked from the file's header before anything is loaded:

- ``general.architecture`` one a registered architecture accepts
  (:func:`~servelab.models.registry.gguf_architectures`: ``llama``,
  ``qwen2``, ``gemma3``); any other raises ``ValueError`` with the
  architecture and the supported list. llama.cpp writes Mistral models (7B v0.1-v0.3...) as
  ``llama``: they load as Llama, which computes the same thing, since GGUF
  records no sliding window. (transformers' reader turns a file whose
  ``general.name`` is exactly ``"mistral"`` into a Mistral config it then
  cannot map; that, like any refusal of the reader, is re-raised as
  ``ValueError`` naming the file.)
- every tensor stored in a type the installed ``gguf`` package can
  dequantize (:func:`supported_gguf_types`: F32, F16, BF16, Q4_0...Q8_0, the
  K-quants, the IQ types...); the first other one raises ``ValueError``
  naming the tensor and its type.

End-of-sequence ids are the header's ``tokenizer.ggml.eos_token_id`` plus its
end-of-turn / end-of-message ids (``eot_token_id``, ``eom_token_id``) when
present, as llama.cpp stops on all of them. The tokenizer (vocabulary,
merges, special tokens, chat template) comes from the same file.

Dequantizing takes seconds per hundred million parameters; to pay it once,
:func:`convert_gguf` writes a HF safetensors folder (config,
``generation_config.json``, tokenizer with its chat template) that loads fast.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from servelab.models.config import ModelConfig
from servelab.models.registry import gguf_architectures

INSTALL_HINT = 'pip install "servelab[gguf]"'
# Used when the installed gguf package does not expose its dequantizer table.
_FALLBACK_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_EXTRA_EOS_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def require_gguf() -> None:
    """Raise ``ImportError`` naming the extra when ``gguf`` or ``accelerate`` is missing."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"loading a .gguf file needs the {' and '.join(missing)} package(s), which "
                          f"transformers' GGUF reader uses: {INSTALL_HINT}")


def supported_gguf_types() -> tuple[str, ...]:
    """Tensor types (GGML type names) the installed ``gguf`` package can dequantize."""
    require_gguf()
    import gguf.quants

    traits = getattr(gguf.quants, "_type_traits", None)
    if not isinstance(traits, dict):
        return _FALLBACK_TYPES
    return ("F32", "F16", *sorted({t.name for t in traits} - {"F32", "F16"}))


@dataclass(frozen=True)
class GGUFInfo:
    """What the header of a GGUF file says (no tensor data read).

    Attributes:
        file: the ``.gguf`` path.
        architecture: ``general.architecture`` (e.g. ``"llama"``).
        name: ``general.name`` or ``""``.
        tensor_types: GGML type name -> number of tensors stored in it.
        eos_token_ids: EOS first, then end-of-turn / end-of-message ids.
    """

    file: Path
    architecture: str
    name: str
    tensor_types: dict[str, int]
    eos_token_ids: tuple[int, ...]


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` designates, or ``None`` for a HF checkpoint folder.

    A ``.gguf`` file is itself; a folder with ``config.json`` is a HF folder
    (``None``); a folder without one but with exactly one ``*.gguf`` is that file.

    Raises:
        ValueError: ``path`` does not exist, is another kind of file, or is a
            folder with neither ``config.json`` nor exactly one ``.gguf``.
    """
    p = Path(path)
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return p
        raise ValueError(f"checkpoint path {str(path)!r} is a file but not a .gguf file; give a checkpoint "
                         "folder (config.json + *.safetensors) or a .gguf file")
    if not p.is_dir():
        raise ValueError(f"checkpoint path {str(path)!r} does not exist")
    if (p / "config.json").is_file():
        return None
    found = sorted(p.glob("*.gguf"))
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(f"{str(path)!r} has no config.json and {len(found)} .gguf files "
                         f"({', '.join(f.name for f in found)}); pass the one to load")
    raise ValueError(f"{str(path)!r} is not a checkpoint folder: config.json not found (and no .gguf file)")


def _field(reader: Any, key: str) -> Any:
    """A scalar or string field of the header, or None."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8", errors="replace")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def check_gguf(file: str | Path) -> GGUFInfo:
    """Read the header of ``file`` and refuse what servelab cannot run.

    Raises:
        ImportError: ``gguf`` / ``accelerate`` missing (names the extra).
        ValueError: not a readable GGUF file, an unsupported architecture, or
            a tensor type the installed ``gguf`` cannot dequantize.
    """
    require_gguf()
    from gguf import GGUFReader

    file = Path(file)
    try:
        reader = GGUFReader(str(file))
    except Exception as exc:  # noqa: BLE001 - bad magic, truncated header, ...
        size = file.stat().st_size if file.exists() else None
        raise ValueError(f"cannot read GGUF file {str(file)!r} ({size} bytes): {exc}") from exc
    arch = _field(reader, "general.architecture")
    if arch not in gguf_architectures():
        raise ValueError(f"GGUF file {file.name!r} has general.architecture={arch!r}, which is not supported; "
                         f"supported: {', '.join(gguf_architectures())} (llama.cpp also writes Mistral as 'llama')")
    supported = set(supported_gguf_types())
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in supported:
            raise ValueError(f"GGUF file {file.name!r}: tensor {tensor.name!r} is stored as {kind}, which the "
                             f"installed gguf package cannot dequantize; supported: {', '.join(sorted(supported))}")
        types[kind] = types.get(kind, 0) + 1
    eos = [_field(reader, "tokenizer.ggml.eos_token_id")] + [_field(reader, k) for k in _EXTRA_EOS_KEYS]
    eos_ids = tuple(dict.fromkeys(int(e) for e in eos if e is not None))
    return GGUFInfo(file, arch, _field(reader, "general.name") or "", types, eos_ids)


def _from_pretrained_args(file: Path) -> tuple[tuple[str], dict[str, Any]]:
    return (str(file.parent),), {"gguf_file": file.name, "local_files_only": True}


def _hf_config(file: Path) -> Any:
    from transformers import AutoConfig

    args, kwargs = _from_pretrained_args(file)
    try:
        hf = AutoConfig.from_pretrained(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers' own refusals, with its reason
        raise ValueError(f"cannot read the config of GGUF file {file.name!r}: {exc}") from exc
    # The reader marks the config as GGUF-quantized; the weights we load are dequantized.
    if getattr(hf, "quantization_config", None) is not None:
        del hf.quantization_config
    return hf


def load_gguf_config(file: str | Path):
    """The validated :class:`~servelab.models.ModelConfig` of a GGUF file (header only)."""
    info = check_gguf(file)
    return ModelConfig.from_hf(_hf_config(info.file), {"eos_token_id": list(info.eos_token_ids)})


def _hf_model(file: Path) -> Any:
    from transformers import AutoModelForCausalLM

    args, kwargs = _from_pretrained_args(file)
    try:
        return AutoModelForCausalLM.from_pretrained(*args, **kwargs)
    except (ValueError, NotImplementedError, KeyError) as exc:  # the reader's refusals
        raise ValueError(f"transformers cannot load GGUF file {file.name!r}: {exc}") from exc


def gguf_tensors(file: str | Path) -> Iterator[tuple[str, torch.Tensor, str]]:
    """``(hf_name, float32 tensor, file name)`` for every weight of the GGUF file, dequantized.

    Goes through ``transformers.AutoModelForCausalLM.from_pretrained(...,
    gguf_file=...)``, so names and q/k layout are transformers' own.
    """
    info = check_gguf(file)
    hf = _hf_model(info.file)
    for name, tensor in hf.state_dict().items():
        yield name, tensor, info.file.name


def load_gguf_tokenizer(file: str | Path) -> Any:
    """The tokenizer stored in a GGUF file (vocabulary, merges, specials, chat template)."""
    from transformers import AutoTokenizer

    info = check_gguf(file)
    args, kwargs = _from_pretrained_args(info.file)
    try:
        return AutoTokenizer.from_pretrained(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"cannot build the tokenizer of GGUF file {info.file.name!r}: {exc}") from exc


def convert_gguf(file: str | Path, out: str | Path) -> Path:
    """Dequantize a GGUF file into a HF safetensors checkpoint folder at ``out``.

    Writes ``config.json`` (without the GGUF ``quantization_config``: the
    weights are plain float32 now), ``model.safetensors``,
    ``generation_config.json`` (BOS / pad and every EOS id of the header) and
    the tokenizer files with the chat template. Returns ``out``.
    """
    with _one_reader():
        return _convert(file, out)


@contextmanager
def _one_reader() -> Iterator[None]:
    """Within the block, a GGUF file is parsed as few times as transformers allows.

    The header check, transformers' config, weights and tokenizer each open
    the file, and parsing a large vocabulary's metadata (Gemma 3: 262,144
    tokens, in Python) takes seconds per open: every ``gguf.GGUFReader(path)``
    of the same file is one reader, and transformers' metadata-only
    ``load_gguf_checkpoint(path, return_tensors=False)`` is computed once
    (each caller gets its own copy). Both are looked up at call time by their
    callers, so patching the module attributes reaches them; they are
    restored on exit."""
    import copy

    try:
        import gguf
        from transformers import modeling_gguf_pytorch_utils as hf_gguf
    except ImportError:  # no gguf extra: nothing to share (a .gguf load names the extra itself)
        yield
        return

    original_reader, original_load, readers, metadata = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, {}, {}

    def shared_reader(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    def shared_load(path: Any, return_tensors: bool = False, **kwargs: Any) -> Any:
        if return_tensors or kwargs:
            return original_load(path, return_tensors=return_tensors, **kwargs)
        key = str(Path(path).resolve())
        if key not in metadata:
            metadata[key] = original_load(path, return_tensors=False)
        return copy.deepcopy(metadata[key])

    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = shared_reader, shared_load
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = original_reader, original_load


def _convert(file: str | Path, out: str | Path) -> Path:
    info = check_gguf(file)
    load_gguf_config(info.file)  # refuse what servelab cannot run before the slow part
    hf = _hf_model(info.file)
    if getattr(hf.config, "quantization_config", None) is not None:
        del hf.config.quantization_config
    if getattr(hf, "hf_quantizer", None) is not None:
        hf.hf_quantizer = None
    eos = list(info.eos_token_ids)
    if eos:
        hf.generation_config.eos_token_id = eos[0] if len(eos) == 1 else eos
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(folder))
    load_gguf_tokenizer(info.file).save_pretrained(str(folder))
    _portable_tokenizer_config(folder / "tokenizer_config.json")
    for file in folder.iterdir():  # some writers create 0600 files; a cache folder is for everyone
        file.chmod(0o644)
    return folder


def _portable_tokenizer_config(file: Path) -> None:
    """Drop load-time flags transformers saves; name the generic fast class (4.x and 5.x, no rebuilding)."""
    if not file.is_file():
        return
    cfg = json.loads(file.read_text())
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    # The generic fast class loads tokenizer.json exactly as saved; a model-specific class
    # (Qwen2Tokenizer in transformers 5) may rebuild the pre-tokenizer and split differently.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ---- native loading: blocks kept as stored (quantization="auto") --------------------------------------------

@dataclass(frozen=True)
class NativeTensor:
    """One GGUF tensor as stored: ``kind`` (GGML type name) and ``data`` (uint8 blocks ``[rows, row_bytes]``
    for a block type, the float values for F32 / F16), ``rows`` x ``cols`` in HF orientation."""

    name: str
    kind: str
    data: Any
    rows: int
    cols: int


class NativeGGUF:
    """A GGUF file's tensors by HF name, read as stored (no dequantization): what
    :func:`servelab.models.loader.load_model` uses for ``quantization="auto"``.

    Names are mapped with ``gguf``'s own tensor-name table for the architecture; llama.cpp's
    rotary permutation of the Llama ``q``/``k`` rows is undone as a row index (:meth:`rows_order`),
    so blocks are reordered, never decoded; Gemma norms are stored as ``w + 1`` by the converter
    and shifted back (:meth:`float_tensor`), as transformers' reader does.
    """

    def __init__(self, file: str | Path, config: ModelConfig) -> None:
        require_gguf()
        import gguf

        info = check_gguf(file)
        self.info, self.config = info, config
        self.reader = gguf.GGUFReader(str(info.file))
        self.tensors = {t.name: t for t in self.reader.tensors}
        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == info.architecture)
        self.names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
        self.used: set[str] = set()

    def gguf_name(self, hf_name: str) -> str | None:
        """``"model.layers.0.self_attn.q_proj.weight"`` -> ``"blk.0.attn_q.weight"`` (None when unmapped)."""
        base, _, suffix = hf_name.rpartition(".")
        mapped = self.names.get_name(base)
        return None if mapped is None else f"{mapped}.{suffix}"

    def has(self, hf_name: str) -> bool:
        name = self.gguf_name(hf_name)
        return name is not None and name in self.tensors

    def get(self, hf_name: str) -> NativeTensor:
        """The stored tensor of ``hf_name`` (ValueError naming it when the file lacks it)."""
        name = self.gguf_name(hf_name)
        if name is None or name not in self.tensors:
            raise ValueError(f"GGUF file {self.info.file.name!r} has no tensor for {hf_name!r} (looked for {name!r})")
        tensor = self.tensors[name]
        self.used.add(name)
        shape = [int(s) for s in tensor.shape]  # GGML order: [cols, rows]
        cols, rows = (shape + [1])[:2]
        import numpy as np

        data = torch.from_numpy(np.array(tensor.data))  # a private copy: the file's pages are let go
        return NativeTensor(name, tensor.tensor_type.name, data.reshape(rows, -1) if rows > 1 else data, rows, cols)

    def rows_order(self, hf_name: str, rows: int) -> torch.Tensor | None:
        """The row index undoing llama.cpp's q/k permutation for ``hf_name`` (None when not permuted)."""
        if self.info.architecture != "llama":
            return None
        last = hf_name.rpartition(".")[0].rpartition(".")[2]
        heads = self.config.num_attention_heads
        if last == "k_proj":
            heads = self.config.num_key_value_heads
        elif last != "q_proj":
            return None
        half = rows // heads // 2
        # transformers' reverse permutation applied to the row numbers: row r of the HF weight is
        # stored row order[r].
        return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)

    def float_tensor(self, hf_name: str) -> torch.Tensor:
        """A float32 tensor of ``hf_name`` (dequantized if stored in blocks; Gemma norms shifted back)."""
        from servelab.quantization.formats import dequantize_gguf

        stored = self.get(hf_name)
        if stored.kind == "F32":
            value = stored.data.float()
        elif stored.kind == "F16":
            value = stored.data.view(torch.float16).float() if stored.data.dtype is torch.uint8 else stored.data.float()
        else:
            value = dequantize_gguf(stored.kind, stored.data.reshape(stored.rows, -1), stored.cols)
        if self.info.architecture.startswith("gemma") and hf_name.endswith("norm.weight"):
            value = value - 1
        order = self.rows_order(hf_name, value.shape[0]) if value.dim() == 2 else None
        return value if order is None else value[order]

    def unused(self) -> list[str]:
        """Tensors of the file nothing asked for (after loading: a mismatch to report)."""
        return sorted(set(self.tensors) - self.used)


_shared_depth = [0]


def shared_reader_active() -> bool:
    """Whether a :func:`shared_gguf_reader` block is open."""
    return _shared_depth[0] > 0


@contextmanager
def shared_gguf_reader() -> Iterator[None]:
    """Within the block, every parse of the same GGUF file is done once (:func:`_one_reader`),
    nested blocks included: header check, config, native tensors and tokenizer of one load share
    one reader (parsing Gemma 3's 262,144-token vocabulary takes tens of seconds per reader)."""
    if _shared_depth[0]:
        _shared_depth[0] += 1
        try:
            yield
        finally:
            _shared_depth[0] -= 1
        return
    with _one_reader():
        _shared_depth[0] = 1
        try:
            yield
        finally:
            _shared_depth[0] = 0
