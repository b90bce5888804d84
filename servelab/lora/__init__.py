"""Many LoRA adapters on one base model (vLLM's design): per-request adapters batched
in one step, a host LRU of loaded adapters and device slots, Punica-style kernels.

- :class:`LoRARequest` names a PEFT adapter folder; :mod:`servelab.lora.peft` loads
  and validates it;
- :class:`LoRALinear` wraps any linear layer with stacked per-slot A/B buffers
  (fused ``qkv_proj`` / ``gate_up_proj`` by output slices);
- :class:`LoRAModelManager`: host cache (``max_cpu_loras``), slots (``max_loras``),
  activate / deactivate / pin;
- the kernel seam: :func:`register_lora_kernel` (``"cpu"``: C, the CPU default; ``"torch"``;
  ``"triton"``; ``"reference"``).

``Pipeline(model, enable_lora=True, max_loras=4, max_lora_rank=16)`` then
``generate(prompts, params, lora_request=LoRARequest("sql", 1, path))``.
See ``docs/lora.md``.
"""

from servelab.lora.kernels import (
    LoRAKernel,
    LoRAMapping,
    available_lora_kernels,
    get_lora_kernel,
    register_lora_kernel,
)
from servelab.lora.layers import LoRALinear, LoRAStepState
from servelab.lora.manager import LoRAManagerStats, LoRAModelManager
from servelab.lora.peft import LoRAAdapter, load_peft_adapter
from servelab.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRAKernel", "LoRALinear", "LoRAManagerStats", "LoRAMapping", "LoRAModelManager",
           "LoRARequest", "LoRAStepState", "available_lora_kernels", "get_lora_kernel", "load_peft_adapter",
           "register_lora_kernel"]
