"""Loading and validating a PEFT LoRA adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``) for one base model.

What is supported, and why the rest is refused (each refusal names the adapter,
the setting and the reason, so a request never falls back to the base model
silently):

- ``peft_type`` ``"LORA"``; ``r`` up to ``max_lora_rank`` (the slots' width);
  scaling ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``;
- modules the model has among its adapted projections (q/k/v/o, gate/up/down;
  fused ``qkv_proj`` / ``gate_up_proj`` take their parts' rows, see
  :mod:`servelab.models.layer_api`); any other module (``embed_tokens``,
  ``lm_head``, a module of another architecture) is refused;
- refused: DoRA (``use_dora``: a per-column norm the batched kernels do not
  apply), LoRA biases (``bias`` other than ``"none"``, ``lora_bias``),
  ``modules_to_save`` (whole replaced modules: not an adapter delta),
  ``fan_in_fan_out`` (Conv1D layouts), per-module ``rank_pattern`` /
  ``alpha_pattern``, pickled ``adapter_model.bin`` (only safetensors is read).

The loaded :class:`LoRAAdapter` keeps float32 ``A [r, in]`` and ``B [out, r]``
with the scaling folded into ``B`` (vLLM's ``optimize()``), on the host.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from servelab.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "adapter_scaling", "load_peft_adapter"]

_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
_REFUSED_FLAGS = {
    "use_dora": "DoRA (a per-column magnitude the batched LoRA kernels do not apply)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weight layout; servelab layers are nn.Linear-shaped)",
    "lora_bias": "LoRA biases (lora_bias)",
}


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter loaded on the host (vLLM's ``LoRAModel``).

    Attributes:
        name, int_id, path: from its :class:`LoRARequest`.
        rank: ``r`` of its config (every module's rank).
        scaling: ``lora_alpha / r`` (or ``/ sqrt(r)`` with rsLoRA), folded into ``weights``' B.
        weights: HF module name (``"model.layers.0.self_attn.q_proj"``) -> (float32 ``A [r, in]``,
            float32 ``B * scaling [out, r]``).
    """

    name: str
    int_id: int
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def adapter_scaling(config: dict[str, Any]) -> float:
    """PEFT's scaling of a LoRA config: ``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``."""
    r, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r


def _refuse(request: LoRARequest, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {why}")


def _read_config(request: LoRARequest, max_rank: int) -> dict[str, Any]:
    path = request.lora_path
    if not os.path.isdir(path):
        raise _refuse(request, "lora_path does not exist or is not a folder")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise _refuse(request, "no adapter_config.json in the folder (not a PEFT adapter)")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise _refuse(request, f"adapter_config.json is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _refuse(request, "adapter_config.json is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _refuse(request, f"peft_type={peft_type!r} is not supported; valid: 'LORA'")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _refuse(request, f"r={r!r} in adapter_config.json is invalid; valid: an int >= 1")
    if r > max_rank:
        raise _refuse(request, f"rank r={r} is above max_lora_rank={max_rank}; raise max_lora_rank")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _refuse(request, f"lora_alpha={alpha!r} is invalid; valid: a finite number")
    for flag, what in _REFUSED_FLAGS.items():
        if config.get(flag):
            raise _refuse(request, f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise _refuse(request, f"bias={config.get('bias')!r} is not supported; valid: 'none'")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _refuse(request, f"{key}={config[key]!r} is not supported (one rank and alpha for every "
                          "adapted module, no replaced modules)")
    return config


def _read_tensors(request: LoRARequest) -> dict[str, torch.Tensor]:
    path = os.path.join(request.lora_path, "adapter_model.safetensors")
    if not os.path.isfile(path):
        other = " (adapter_model.bin is not read: only safetensors)" if os.path.isfile(
            os.path.join(request.lora_path, "adapter_model.bin")) else ""
        raise _refuse(request, f"no adapter_model.safetensors in the folder{other}")
    try:
        from safetensors.torch import load_file
        return load_file(path, device="cpu")
    except Exception as exc:  # a truncated or foreign file: safetensors raises several kinds
        raise _refuse(request, f"adapter_model.safetensors is not readable ({type(exc).__name__}: {exc})") from None


def load_peft_adapter(request: LoRARequest, *, max_rank: int,
                      modules: dict[str, tuple[int, int]]) -> LoRAAdapter:
    """Load ``request``'s folder, checked against the model.

    Args:
        request: the adapter.
        max_rank: largest rank accepted (``max_lora_rank``).
        modules: HF module name -> ``(in_features, out_features)`` of every module the
            model can adapt (the parts of fused layers included).

    Raises:
        ValueError: naming the adapter and why (see the module docstring).
    """
    config = _read_config(request, max_rank)
    r = config["r"]
    scaling = adapter_scaling(config)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(request).items():
        match = _KEY.match(key)
        if match is None:
            raise _refuse(request, f"tensor {key!r} is not a LoRA A/B weight (embeddings, biases and saved "
                          "modules are not supported)")
        module = match.group("module")
        if module not in modules:
            known = sorted({m.rsplit(".", 1)[-1] for m in modules})
            raise _refuse(request, f"module {module!r} is not an adaptable module of this model (adaptable: "
                          f"{', '.join(known)} of each layer)")
        parts.setdefault(module, {})[match.group("part")] = tensor
    if not parts:
        raise _refuse(request, "adapter_model.safetensors holds no LoRA weights")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in sorted(parts.items()):
        if set(pair) != {"A", "B"}:
            raise _refuse(request, f"module {module!r} has lora_{''.join(pair)} but not both lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        in_features, out_features = modules[module]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, in_features) or tuple(b.shape) != (out_features, r):
            raise _refuse(request, f"module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                          f"this model needs ({r}, {in_features}) and ({out_features}, {r}) (r={r}): an adapter "
                          "for another base model?")
        a32, b32 = a.float(), b.float() * scaling
        if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
            raise _refuse(request, f"module {module!r} has non-finite LoRA weights")
        weights[module] = (a32.contiguous(), b32.contiguous())
    return LoRAAdapter(request.lora_name, request.lora_int_id, request.lora_path, r, scaling, weights)
