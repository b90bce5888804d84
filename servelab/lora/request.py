"""``LoRARequest``: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["LoRARequest"]


@dataclass(frozen=True)
class LoRARequest:
    """An adapter in PEFT's format for one request.

    Attributes:
        lora_name: the adapter's name; it keys the prefix cache (two adapters
            never share KV blocks) and the adapter caches.
        lora_int_id: a positive int id, unique per adapter (vLLM's ``lora_int_id``).
        lora_path: a folder with ``adapter_config.json`` and
            ``adapter_model.safetensors`` (what ``peft``'s ``save_pretrained`` writes).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise ValueError(f"LoRARequest.lora_name={self.lora_name!r} is invalid; valid: a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} (adapter {self.lora_name!r}) is "
                             "invalid; valid: an int >= 1")
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path={self.lora_path!r} (adapter {self.lora_name!r}) is invalid; "
                             "valid: the path of a PEFT adapter folder")


def check_lora_request(value: Any) -> LoRARequest | None:
    """``value`` if it is None or a :class:`LoRARequest`, else ``TypeError``."""
    if value is None or isinstance(value, LoRARequest):
        return value
    raise TypeError(f"lora_request must be a servelab.lora.LoRARequest or None, got {type(value).__name__}")
