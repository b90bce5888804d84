"""``attach_lora``: the ``enable_lora`` step of :data:`servelab.pipeline.setup.MODEL_STEPS`.

Every linear layer inside the decoder layers (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj`` — whatever each now is: dense, quantized or a
tensor-parallel shard) is wrapped in a :class:`~servelab.lora.layers.LoRALinear`
with ``max_loras`` slots of width ``max_lora_rank``. The LM head and the
embeddings are not (adapters naming them are refused when loaded). The model
gets ``model.lora_manager`` (a :class:`~servelab.lora.manager.LoRAModelManager`),
which the pipeline reads.
"""

from __future__ import annotations

from typing import Any

from servelab.config import PipelineConfig
from servelab.lora.kernels import get_lora_kernel
from servelab.lora.layers import LoRALinear, LoRAStepState
from servelab.lora.manager import LoRAModelManager
from servelab.models.layer_api import linear_layers, replace_module

__all__ = ["attach_lora", "wrap_model"]


def wrap_model(model: Any, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None,
               kernel: Any = "auto") -> LoRAModelManager:
    """Wrap ``model``'s decoder linear layers in place; returns (and sets ``model.lora_manager`` to)
    their manager. A model already wrapped is refused (``ValueError``)."""
    if getattr(model, "lora_manager", None) is not None:
        raise ValueError("the model already has LoRA wrappers (model.lora_manager); wrap a model once")
    state = LoRAStepState(get_lora_kernel(kernel, model.device))
    layers: dict[str, LoRALinear] = {}
    targets = [(name, layer) for name, layer in linear_layers(model) if ".layers." in f".{name}"]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no linear layers inside decoder layers to adapt")
    for name, layer in targets:
        wrapped = LoRALinear(layer, name, max_loras=max_loras, max_rank=max_lora_rank, state=state,
                             dtype=model.dtype)
        replace_module(model, name, wrapped)
        layers[name] = wrapped
    manager = LoRAModelManager(layers, state, max_loras=max_loras, max_lora_rank=max_lora_rank,
                               max_cpu_loras=max_cpu_loras)
    object.__setattr__(model, "lora_manager", manager)  # not a submodule: no state_dict entries
    return manager


def attach_lora(model: Any, config: PipelineConfig, **context: Any) -> Any:
    """The MODEL_STEPS hook: wrap ``model`` per ``config.lora``; returns the model."""
    lora = config.lora
    wrap_model(model, max_loras=lora.max_loras, max_lora_rank=lora.max_lora_rank, max_cpu_loras=lora.max_cpu_loras)
    return model
