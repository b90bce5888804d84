"""Load HF checkpoint folders into :class:`LlamaForCausalLM`; size and allocate the KV cache.

A checkpoint folder holds ``config.json`` and either one ``*.safetensors``
file or several with ``model.safetensors.index.json`` mapping each tensor to
its shard. Tensors are read with ``safetensors`` (memory-mapped, never a
pickle), one at a time, cast to the model dtype and copied into place; HF's
separate ``q/k/v_proj`` and ``gate/up_proj`` land in row ranges of the fused
``qkv_proj`` / ``gate_up_proj``. Every destination must be written exactly
once: missing, unexpected, duplicated or mis-shaped tensors raise
``ValueError`` naming the tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from servelab.blocks.layout import KVCacheBuffers, allocate_kv_cache
from servelab.blocks.specs import FullAttentionSpec, SlidingWindowSpec
from servelab.models.config import ModelConfig, load_config
from servelab.models.llama import LlamaForCausalLM

INDEX_FILE = "model.safetensors.index.json"
# HF projection name -> (fused parameter, which part).
_PACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}
# Tensors some exporters add that carry no weights we need.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


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


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, path: str | Path) -> None:
    """Copy every tensor of the checkpoint at ``path`` into ``model``'s parameters.

    Raises:
        ValueError: an unexpected tensor (not a parameter of this config), a
            shape mismatch, a tensor present twice, or parameters left unset
            (all named with their HF names).
    """
    from safetensors import safe_open

    config = model.config
    params = dict(model.named_parameters())
    # What is still to be written: (param, row range or None) per HF tensor name.
    pending: dict[str, tuple[str, tuple[int, int] | None]] = {}
    for pname in params:
        mod, _, leaf = pname.rpartition(".")
        fused = mod.rpartition(".")[2]
        if fused in ("qkv_proj", "gate_up_proj"):
            prefix = mod.rpartition(".")[0]
            for hf_name, (target, piece) in _PACKED.items():
                if target == fused:
                    pending[f"{prefix}.{hf_name}.{leaf}"] = (pname, _slices(config)[piece])
        else:
            pending[pname] = (pname, None)
    seen: set[str] = set()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if _IGNORED.search(name):
                    continue
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: the head is the embedding (HF also ignores a saved copy)
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears twice in the checkpoint (again in {file.name})")
                dest = pending.pop(name, None)
                if dest is None:
                    raise ValueError(
                        f"unexpected tensor {name!r} in {file.name}: no such parameter in a "
                        f"{config.arch} model with this config"
                        + (" (bias given but the config has no bias there)" if name.endswith(".bias") else "")
                    )
                pname, rows = dest
                target = params[pname] if rows is None else params[pname][rows[0]:rows[1]]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)}; the config "
                        f"implies {tuple(target.shape)}"
                    )
                target.copy_(tensor.to(dtype=target.dtype))
                seen.add(name)
    if pending:
        names = sorted(pending)
        shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        raise ValueError(f"checkpoint {str(path)!r} is missing {len(names)} tensor(s): {shown}")


def _default_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    # float32 on CPU (bf16 matmuls are slow there and the oracle runs fp32);
    # elsewhere the checkpoint's own half-precision dtype when it has one.
    if device.type != "cpu" and config.dtype in (torch.float16, torch.bfloat16):
        return config.dtype
    return torch.float32


def load_model(path: str | Path, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu", attention: Any = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for the checkpoint folder ``path`` and load its weights.

    Args:
        dtype: parameter / activation dtype: float32, bfloat16 or float16 (or
            their names). Default: float32 on CPU, else the checkpoint's dtype
            if half precision, else float32.
        device: where the parameters live.
        attention: attention ops or backend name (default ``"torch"``).

    Returns:
        ``(model, config)`` with the model in eval mode.
    """
    config = load_config(path)
    device = torch.device(device)
    dtype = _resolve_model_dtype(dtype) if dtype is not None else _default_dtype(config, device)
    # Build on the meta device: no time spent initializing weights we overwrite.
    model = LlamaForCausalLM(config, attention, dtype=dtype, device="meta")
    model = model.to_empty(device=device)
    load_weights(model, path)
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
                       layout: str = "layer_outermost") -> KVCacheBuffers:
    """One zeroed buffer with a ``(key_cache, value_cache)`` view per layer.

    ``num_blocks`` counts the null block 0 like :class:`~servelab.blocks.BlockPool`.
    ``dtype``/``device`` default to the model's (float32/CPU for a bare config).
    Pass the result (or its ``.views``) as ``kv_caches`` to the model.
    """
    is_model = isinstance(model, LlamaForCausalLM)
    cfg = _as_config(model)
    if dtype is None:
        dtype = model.dtype if is_model else torch.float32
    if device is None:
        device = model.device if is_model else "cpu"
    spec = kv_cache_spec(cfg, block_size, dtype)
    return allocate_kv_cache(spec, cfg.num_hidden_layers, num_blocks, layout=layout, device=device)
