"""How a :class:`~servelab.Pipeline` takes LoRA on: the model's manager bound to the
runner (:func:`bind_lora`), and each request's adapter checked as it is added
(:func:`request_lora_name`). Kept here so the pipeline only calls two functions."""

from __future__ import annotations

from typing import Any

from servelab.config import PipelineConfig
from servelab.lora.manager import LoRAModelManager
from servelab.lora.request import LoRARequest, check_lora_request
from servelab.lora.serving import LoRAServing

__all__ = ["bind_lora", "request_lora_name"]


def bind_lora(config: PipelineConfig, model: Any, runner: Any) -> tuple[LoRAModelManager | None, LoRAServing | None]:
    """``(manager, serving)`` of a model wrapped by ``enable_lora`` (set as ``runner.lora``),
    ``(None, None)`` without it."""
    manager = getattr(model, "lora_manager", None)
    if not config.lora.enable_lora:
        if manager is not None:
            raise ValueError("the model has LoRA wrappers (model.lora_manager) but enable_lora=False; pass "
                             "enable_lora=True (with the same max_loras / max_lora_rank)")
        return None, None
    if not hasattr(runner, "lora"):
        raise ValueError(f"enable_lora needs the in-process model runner; {type(runner).__name__} (parallel "
                         "workers) does not carry LoRA adapters yet")
    if not isinstance(manager, LoRAModelManager):
        raise ValueError("enable_lora=True but the model has no LoRA manager (prepare_model's attach_lora step "
                         "did not run)")
    if manager.max_loras != config.lora.max_loras or manager.max_lora_rank != config.lora.max_lora_rank:
        raise ValueError(f"the model was wrapped with max_loras={manager.max_loras}, max_lora_rank="
                         f"{manager.max_lora_rank}; the config asks for {config.lora.max_loras}, "
                         f"{config.lora.max_lora_rank}")
    serving = LoRAServing(manager)
    runner.lora = serving
    return manager, serving


def request_lora_name(serving: LoRAServing | None, request_id: str, lora_request: Any) -> str | None:
    """The adapter name a request's KV blocks are keyed by (None: the base model), after its
    adapter is loaded and checked; ``ValueError`` / ``TypeError`` naming the adapter otherwise."""
    lora_request = check_lora_request(lora_request)
    if lora_request is None:
        return None
    if serving is None:
        raise ValueError(f"lora_request for adapter {lora_request.lora_name!r} needs a pipeline with "
                         "enable_lora=True; this one serves the base model only")
    serving.add_request(request_id, lora_request)
    return lora_request.lora_name


def per_prompt_lora_requests(lora_request: Any, num_prompts: int) -> list[Any]:
    """``generate``'s ``lora_request``: None, one for every prompt, or a list of ``num_prompts``
    (None entries: the base model). A malformed call raises ``ValueError`` / ``TypeError``."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, (list, tuple)) and len(lora_request) == num_prompts:
        for item in lora_request:
            check_lora_request(item)
        return list(lora_request)
    raise ValueError(f"lora_request must be None, one LoRARequest, or a list of {num_prompts} (one per prompt, "
                     f"None for the base model), got {type(lora_request).__name__}")
