"""Load HF checkpoint folders into :class:`LlamaForCausalLM`; size and allocate the KV cache.

A checkpoint folder holds ``config.json`` and either one ``*.safetensors``
file or several with ``model.safetensors.index.json`` mapping each tensor to
its shard. Tensors are read with ``safetensors`` (memory-mapped, never a
pickle), one at a time, cast to the model dtype and copied into place; HF's
separate ``q/k/v_proj`` and ``gate/up_proj`` land in row ranges of the fused
``qkv_proj`` / ``gate_up_proj``. Every destination must be written exactly
once: missing, unexpected, duplicated or mis-shaped tensors raise
``ValueError`` naming the tensor, and so does a tensor holding NaN or
infinity (after the cast to the model dtype: an overflow counts), since such
a model would only ever emit garbage. A zero-byte, truncated or otherwise
unreadable ``*.safetensors`` file raises ``ValueError`` naming the file, its
size and the reader's complaint.

:func:`load_model` also takes a ``.gguf`` file, or a folder holding one and
no ``config.json`` (see :mod:`servelab.models.gguf`); its weights pass through
the same checks.
"""

from __future__ import annotations

import dataclasses

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from servelab.blocks.layout import KVCacheBuffers, allocate_kv_cache
from servelab.blocks.specs import FullAttentionSpec, SlidingWindowSpec
from servelab.models.config import ModelConfig, read_generation_config
from servelab.models.gguf import (NativeGGUF, find_gguf_file, gguf_tensors, load_gguf_config, shared_gguf_reader,
                                  shared_reader_active)
from servelab.models.linear import set_weight_packing
from servelab.models.llama import LlamaForCausalLM
from servelab.models.registry import model_class_for

INDEX_FILE = "model.safetensors.index.json"
# HF projection name -> (fused parameter, which part).
_PACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}
# Tensors some exporters add that carry no weights we need.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def load_config(path: str | Path) -> ModelConfig:
    """Read and validate the config of a checkpoint folder or a GGUF file.

    A folder: ``config.json`` through ``transformers.AutoConfig`` (local files
    only) plus ``generation_config.json`` when present (EOS ids, sampling
    defaults). A ``.gguf`` file, or a folder holding one and no
    ``config.json``: the GGUF metadata (see :mod:`servelab.models.gguf`).
    """
    from transformers import AutoConfig

    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return load_gguf_config(gguf_file)
    folder = Path(path)
    try:
        hf = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - unknown model_type, HF's own validators, bad JSON...
        raise ValueError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    return ModelConfig.from_hf(hf, read_generation_config(folder))



def checkpoint_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint folder (via the index when sharded)."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} lists shard(s) not in the folder: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors in {str(folder)!r} (pickled *.bin checkpoints are not loaded: convert them)"
        )
    return files


def _slices(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Row range of each part inside the fused parameters."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "gate": (0, inter), "up": (inter, 2 * inter)}


class _WeightCopier:
    """Copies HF-named tensors into a model's (fused) parameters, checking each one."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        # What is still to be written: (param, row range or None) per HF tensor name.
        self.pending: dict[str, tuple[str, tuple[int, int] | None]] = {}
        slices = _slices(model.config)
        for pname in self.params:
            mod, _, leaf = pname.rpartition(".")
            fused = mod.rpartition(".")[2]
            if fused in ("qkv_proj", "gate_up_proj"):
                prefix = mod.rpartition(".")[0]
                for hf_name, (target, piece) in _PACKED.items():
                    if target == fused:
                        self.pending[f"{prefix}.{hf_name}.{leaf}"] = (pname, slices[piece])
            else:
                self.pending[pname] = (pname, None)
        self.seen: set[str] = set()

    def wants(self, name: str) -> bool:
        """False for tensors that are skipped on purpose (RoPE buffers, a tied head's copy)."""
        return not (_IGNORED.search(name) or (name == "lm_head.weight" and self.model.lm_head is None))

    def add(self, name: str, tensor: torch.Tensor, source: str) -> None:
        config = self.model.config
        if name in self.seen:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint (again in {source})")
        dest = self.pending.pop(name, None)
        if dest is None:
            raise ValueError(
                f"unexpected tensor {name!r} in {source}: no such parameter in a "
                f"{config.arch} model with this config"
                + (" (bias given but the config has no bias there)" if name.endswith(".bias") else "")
            )
        pname, rows = dest
        target = self.params[pname] if rows is None else self.params[pname][rows[0]:rows[1]]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"tensor {name!r} in {source} has shape {tuple(tensor.shape)}; the config "
                f"implies {tuple(target.shape)}"
            )
        target.copy_(tensor.to(dtype=target.dtype))
        finite = torch.isfinite(target)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            first = tuple(int(i) for i in (~finite).nonzero()[0])
            raise ValueError(
                f"tensor {name!r} in {source} has {bad} non-finite value(s) (NaN or inf once cast to "
                f"{target.dtype}), the first at index {first}: the checkpoint is corrupt or overflows this dtype"
            )
        self.seen.add(name)

    def finish(self, where: str) -> None:
        if self.pending:
            names = sorted(self.pending)
            shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise ValueError(f"checkpoint {where!r} is missing {len(names)} tensor(s): {shown}")


@torch.no_grad()
def copy_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor, str]], where: str) -> None:
    """Copy ``(hf_name, tensor, source)`` triples into ``model`` with every check of :func:`load_weights`.

    ``source`` names where the tensor came from (a file name) for messages;
    ``where`` names the checkpoint in the "missing tensors" message.
    """
    copier = _WeightCopier(model)
    convert = getattr(model, "checkpoint_tensors", None)  # a model's own name/stacking map (MoE experts)
    if callable(convert):
        tensors = convert(tensors)
    for name, tensor, source in tensors:
        if copier.wants(name):
            copier.add(name, tensor, source)
    copier.finish(where)


def _unreadable(file: Path, exc: BaseException) -> ValueError:
    size = file.stat().st_size if file.exists() else None
    what = ("the file is empty (0 bytes)" if size == 0 else
            f"the file ({size} bytes) is truncated or corrupt" if size is not None else "the file disappeared")
    return ValueError(f"cannot read safetensors file {str(file)!r}: {what}: {exc}. Re-download or re-save it.")


def _safetensors_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Every tensor of the checkpoint folder, one at a time, with its file's name."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: both mean "bad file"
            raise _unreadable(file, exc) from exc
        with handle as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as exc:  # noqa: BLE001
                    raise _unreadable(file, exc) from exc
                yield name, tensor, file.name


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, path: str | Path) -> None:
    """Copy every tensor of the checkpoint folder at ``path`` into ``model``'s parameters.

    Raises:
        ValueError: an unreadable safetensors file (named, with its size), an
            unexpected tensor (not a parameter of this config), a shape
            mismatch, a tensor present twice, a non-finite value, or
            parameters left unset (all named with their HF names).
    """
    copy_weights(model, _safetensors_tensors(path), str(path))


def _default_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    # float32 on CPU (bf16 matmuls are slow there and the oracle runs fp32);
    # elsewhere the checkpoint's own half-precision dtype when it has one.
    if device.type != "cpu" and config.dtype in (torch.float16, torch.bfloat16):
        return config.dtype
    return torch.float32


def load_model(path: str | Path, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu", attention: Any = None, *,
               pack_weights: bool = True, quantization: Any = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for the checkpoint folder (or ``.gguf`` file) ``path`` and load its weights.

    Args:
        path: a HF checkpoint folder (``config.json`` + ``*.safetensors``), a
            ``.gguf`` file, or a folder holding one ``.gguf`` and no
            ``config.json`` (needs ``pip install "servelab[gguf]"``).
        dtype: parameter / activation dtype: float32, bfloat16 or float16 (or
            their names). Default: float32 on CPU, else the checkpoint's dtype
            if half precision, else float32.
        device: where the parameters live.
        attention: attention ops or backend name (default ``"torch"``).
        pack_weights: run the linear layers and the LM head on weights packed for
            oneDNN where that applies (float32 on a CPU; see
            :mod:`servelab.models.linear`: 1.2-1.9x faster GEMMs, one extra copy of
            each weight); False keeps plain ``F.linear``.
        quantization: for a ``.gguf`` file, anything but None / ``"none"`` (``"auto"``, a dict
            with ``targets`` / ``ignore``) keeps its blocks as stored
            (:mod:`servelab.quantization.gguf_native`; the plan is ``model.quantization_plan``);
            None dequantizes every tensor to ``dtype``. Online methods are applied later, by the
            pipeline's model step (:func:`servelab.quantization.apply.quantize_model`).

    Returns:
        ``(model, config)`` with the model in eval mode.
    """
    if not isinstance(pack_weights, bool):
        raise TypeError(f"pack_weights must be a bool, got {type(pack_weights).__name__} {pack_weights!r}")
    gguf_file = find_gguf_file(path)
    if gguf_file is not None and not shared_reader_active():  # one parse of the file for the whole load
        with shared_gguf_reader():
            return load_model(path, dtype, device, attention, pack_weights=pack_weights, quantization=quantization)
    config = load_config(path)
    device = torch.device(device)
    dtype = _resolve_model_dtype(dtype) if dtype is not None else _default_dtype(config, device)
    # Build on the meta device: no time spent initializing weights we overwrite.
    model = model_class_for(config)(config, attention, dtype=dtype, device="meta")  # the registry's class
    model = model.to_empty(device=device)
    if gguf_file is None:
        load_weights(model, path)
    elif quantization is not None and not (isinstance(quantization, str) and quantization.lower() == "none"):
        # imported here: servelab.quantization's layers import servelab.models (the package) at load time
        from servelab.quantization.gguf_native import load_native_weights

        load_native_weights(model, NativeGGUF(gguf_file, config), quantization)
    else:
        copy_weights(model, gguf_tensors(gguf_file), str(gguf_file))
    set_weight_packing(model, pack_weights)
    return model.eval().requires_grad_(False), config


def _resolve_model_dtype(dtype: torch.dtype | str) -> torch.dtype:
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    resolved = names.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype!r} is not supported; use float32, bfloat16 or float16")
    return resolved


def _as_config(config: Any) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, LlamaForCausalLM):
        return config.config
    if hasattr(config, "model_type"):  # a transformers config object
        return ModelConfig.from_hf(config)
    raise TypeError(f"expected a ModelConfig, a transformers config or a model, got {type(config).__name__}")


def kv_cache_spec(config: Any, block_size: int, dtype: torch.dtype | str = torch.float32
                  ) -> FullAttentionSpec | SlidingWindowSpec:
    """The per-layer KV-cache spec for a model config (or model, or transformers config).

    ``SlidingWindowSpec`` when every layer slides with the same window (the
    manager may then drop blocks that fell out of it); ``FullAttentionSpec``
    otherwise — a mix of full and sliding layers keeps every block, which is
    always correct (the window is still applied as a mask).
    """
    cfg = _as_config(config)
    common = dict(block_size=block_size, num_kv_heads=cfg.num_key_value_heads, head_size=cfg.head_dim, dtype=dtype)
    window = cfg.sliding_window
    if window is not None:
        return SlidingWindowSpec(sliding_window=window, **common)
    return FullAttentionSpec(**common)


def allocate_kv_caches(model: LlamaForCausalLM | Any, num_blocks: int, block_size: int, *,
                       dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
                       layout: str = "layer_outermost", kv_scale: str | None = None) -> KVCacheBuffers:
    """One buffer with a ``(key_cache, value_cache)`` view per layer.

    Not zero-filled except the null block 0 (see ``zero_fill`` of
    :func:`~servelab.blocks.layout.allocate_kv_cache`): no backend reads a
    slot before this step's ``reshape_and_cache`` wrote it, and an idle pool
    then costs no resident memory. ``num_blocks`` counts the null block 0
    like :class:`~servelab.blocks.BlockPool`.
    ``dtype``/``device`` default to the model's (float32/CPU for a bare config).
    Pass the result (or its ``.views``) as ``kv_caches`` to the model.
    A quantized ``dtype`` (int8 / fp8) with ``kv_scale`` (``"token_head"``, ``"head"``,
    ``"tensor"``) gives ``(key_cache, value_cache, k_scale, v_scale)`` per layer
    (:mod:`servelab.blocks.kv_quant`).
    """
    is_model = isinstance(model, LlamaForCausalLM)
    cfg = _as_config(model)
    if dtype is None:
        dtype = model.dtype if is_model else torch.float32
    if device is None:
        device = model.device if is_model else "cpu"
    spec = kv_cache_spec(cfg, block_size, dtype)
    if kv_scale is not None:
        spec = dataclasses.replace(spec, kv_scale=kv_scale)
    return allocate_kv_cache(spec, cfg.num_hidden_layers, num_blocks, layout=layout, device=device,
                             zero_fill=False)
