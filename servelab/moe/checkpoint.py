"""Per-expert checkpoint tensors -> the stacked expert parameters of :class:`~servelab.moe.layer.MoEExperts`.

MoE checkpoints on disk (and what transformers' ``save_pretrained`` writes)
hold one tensor per expert and projection::

    model.layers.0.mlp.experts.3.gate_proj.weight          [I, H]   (Qwen2/3-MoE, OLMoE)
    model.layers.0.block_sparse_moe.experts.3.w1.weight    [I, H]   (Mixtral: w1 gate, w3 up, w2 down)
    model.layers.0.block_sparse_moe.gate.weight            [E, H]   (Mixtral's router)

:func:`convert_checkpoint_tensors` wraps the loader's stream of
``(name, tensor, source)``: Mixtral's ``block_sparse_moe.`` becomes ``mlp.``,
and a layer's per-expert tensors are held until all ``E`` experts of a
projection arrived, then emitted once as ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` / ``mlp.experts.down_proj`` ``[E, H, I]``, what the loader
copies with its usual checks. Tensors already stacked (transformers 5's
in-memory names) pass through. An expert given twice or an expert index out
of range is a ``ValueError`` naming the tensor; an incomplete set leaves the
stacked parameter unwritten, which the loader reports as missing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

__all__ = ["convert_checkpoint_tensors"]

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.weight$")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


def _canonical(name: str) -> str:
    """Mixtral's ``block_sparse_moe.`` / ``w1,w2,w3`` names as the others'."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    match = _MIXTRAL_EXPERT.search(name)
    if match:
        name = name[:match.start()] + f".experts.{match.group(1)}.{_MIXTRAL_NAMES[match.group(2)]}.weight"
    return name


def convert_checkpoint_tensors(tensors: Iterable[tuple[str, torch.Tensor, str]],
                               num_experts: int) -> Iterator[tuple[str, torch.Tensor, str]]:
    """The loader's tensor stream with per-expert tensors stacked (see the module docstring)."""
    pending: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # prefix -> proj -> expert -> tensor
    for name, tensor, source in tensors:
        name = _canonical(name)
        match = _PER_EXPERT.match(name)
        if match is None:
            yield name, tensor, source
            continue
        prefix, expert, proj = match.group("prefix"), int(match.group("expert")), match.group("proj")
        if expert >= num_experts:
            raise ValueError(f"tensor {name!r} in {source} names expert {expert}; the config has {num_experts}")
        parts = pending.setdefault(prefix, {}).setdefault(proj, {})
        if expert in parts:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint (again in {source})")
        parts[expert] = tensor
        done = pending[prefix]
        if proj == "down_proj" and len(parts) == num_experts:
            yield f"{prefix}.down_proj", torch.stack([parts[e] for e in range(num_experts)]), source
            del done["down_proj"]
        elif (proj != "down_proj" and len(done.get("gate_proj", {})) == num_experts
              and len(done.get("up_proj", {})) == num_experts):
            gate, up = done.pop("gate_proj"), done.pop("up_proj")
            stacked = torch.stack([torch.cat([gate[e], up[e]], dim=0) for e in range(num_experts)])
            yield f"{prefix}.gate_up_proj", stacked, source
