"""Adapter loads in the simulator's step cost: :class:`LoRAStepCost` wraps any simulator cost
model (:mod:`servelab.scheduling.simulator`) and charges what serving LoRA adapters adds.

The scheduler is the real one: give the simulator ``SchedulerConfig(max_loras=...)`` and
trace requests with a ``lora_name``, and its ``max_loras`` constraint decides admissions as in
a pipeline. This model then adds, per step (seconds):

- ``load_s`` for each adapter the step needs that is not in a slot (slots kept LRU, at most
  ``max_loras``, as :class:`~servelab.lora.manager.LoRAModelManager` does): reading the folder
  and writing every wrapped layer's slot (``bench/lora.py`` measures ``load_ms`` and
  ``activate_ms``);
- ``per_adapter_s`` for each distinct adapter in the step (a GEMM pair per slot and layer);
- ``per_lora_token_s`` for each scheduled token of a request with an adapter.

Counts of the run: ``loads``, ``steps_with_loads`` on the object (summed over its timers).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["LoRAStepCost"]


class LoRAStepCost:
    """``base``'s step time plus adapter loads and LoRA compute (see the module docstring).

    Args:
        base: a simulator cost model (``timer()``, ``time_of(out)`` or ``step_time(tokens, kv)``).
        adapter_of: request id -> adapter name (requests not in it: the base model), or a callable.
        max_loras: device slots (the pipeline's ``max_loras``).
        load_s, per_adapter_s, per_lora_token_s: the added costs (>= 0).
    """

    def __init__(self, base: Any, adapter_of: Mapping[str, str | None] | Callable[[str], str | None], *,
                 max_loras: int, load_s: float = 5e-3, per_adapter_s: float = 1e-4,
                 per_lora_token_s: float = 0.0) -> None:
        for name, value in (("load_s", load_s), ("per_adapter_s", per_adapter_s),
                            ("per_lora_token_s", per_lora_token_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"LoRAStepCost.{name}={value!r} is invalid; valid: a number >= 0")
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"LoRAStepCost.max_loras={max_loras!r} is invalid; valid: an int >= 1")
        self.base = base
        self._adapter_of = adapter_of.get if isinstance(adapter_of, Mapping) else adapter_of
        self.max_loras = max_loras
        self.load_s, self.per_adapter_s, self.per_lora_token_s = load_s, per_adapter_s, per_lora_token_s
        self.loads = 0
        self.steps_with_loads = 0

    def timer(self) -> Callable[[Any], float]:
        """One run's (one replica's) step cost, with its own slots."""
        from servelab.scheduling.simulator.loop import step_timer

        base_time = step_timer(self.base)
        slots: OrderedDict[str, None] = OrderedDict()

        def time_of(out: Any) -> float:
            names: dict[str, None] = {}
            lora_tokens = 0
            for rid, n in out.num_scheduled_tokens.items():
                name = self._adapter_of(rid)
                if name is not None:
                    names[name] = None
                    lora_tokens += n
            loads = 0
            for name in names:
                if name in slots:
                    slots.move_to_end(name)
                    continue
                while len(slots) >= self.max_loras:
                    victim = next((v for v in slots if v not in names), None)
                    if victim is None:  # more adapters than slots in one step: the scheduler prevents it
                        raise ValueError(f"a step uses {len(names)} adapters, more than max_loras="
                                         f"{self.max_loras}; give the scheduler the same max_loras")
                    del slots[victim]
                slots[name] = None
                loads += 1
            self.loads += loads
            self.steps_with_loads += bool(loads)
            return (base_time(out) + loads * self.load_s + len(names) * self.per_adapter_s
                    + lora_tokens * self.per_lora_token_s)

        return time_of

    def time_of(self, out: Any) -> float:
        """One step alone (fresh slots): every adapter in it is loaded."""
        return self.timer()(out)
