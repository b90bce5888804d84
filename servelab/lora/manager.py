"""The adapter manager (vLLM's ``LoRAModelManager`` with its two LRU caches).

- **Host cache**: up to ``max_cpu_loras`` adapters loaded from their folders
  (:class:`~servelab.lora.peft.LoRAAdapter`), least recently used evicted first;
  an evicted adapter is loaded again from its path when a request needs it.
- **Device slots**: ``max_loras`` slots of every wrapped layer's stacked A/B
  buffers (:class:`~servelab.lora.layers.LoRALinear`). ``activate_adapter`` puts an
  adapter in a slot: its own if already active, else a free one, else the
  least recently used slot whose adapter is not pinned; if every slot is
  pinned it raises ``RuntimeError("No free lora slots ...")``.
  ``lora_index_to_id`` is the slot -> adapter id table (None: free).
- **Pinning**: an adapter in use by a running request is pinned (a count per
  adapter); pinned adapters are never evicted from a slot or from the host.

The scheduler keeps the distinct adapters of running requests within
``max_loras`` (:mod:`servelab.scheduling.lora_slots`), so a step's adapters
always find slots.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from servelab.lora.layers import LoRALinear, LoRAStepState
from servelab.lora.peft import LoRAAdapter, load_peft_adapter
from servelab.lora.request import LoRARequest

__all__ = ["LoRAManagerStats", "LoRAModelManager"]


@dataclass
class LoRAManagerStats:
    """Counts and seconds of the caches' work (what the study reports)."""

    loads: int = 0
    load_seconds: float = 0.0
    activations: int = 0
    activate_seconds: float = 0.0
    host_evictions: int = 0
    slot_evictions: int = 0


class LoRAModelManager:
    """The host cache and the device slots of one model's adapters (see the module docstring).

    Args:
        layers: qualified name -> wrapped layer, every :class:`LoRALinear` of the model.
        state: the wrapped layers' shared :class:`LoRAStepState`.
        max_loras, max_lora_rank, max_cpu_loras: the :class:`~servelab.config.LoRAConfig` settings
            (``max_cpu_loras`` None: ``max_loras``).
        loader: loads and validates one adapter (default :func:`~servelab.lora.peft.load_peft_adapter`).
    """

    def __init__(self, layers: dict[str, LoRALinear], state: LoRAStepState, *, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int | None = None,
                 loader: Callable[..., LoRAAdapter] = load_peft_adapter) -> None:
        self.layers = layers
        self.state = state
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        self.loader = loader
        self.modules: dict[str, tuple[int, int]] = {}
        for layer in layers.values():
            for part, hf_name in zip(layer.slices, layer.hf_names):
                self.modules[hf_name] = (layer.in_features, part.size)
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._known: dict[str, LoRARequest] = {}
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # active adapters, least recently used first
        self.lora_index_to_id: list[int | None] = [None] * max_loras
        self._pins: Counter[str] = Counter()
        self.stats = LoRAManagerStats()

    @property
    def kernel(self) -> object:
        return self.state.kernel

    @kernel.setter
    def kernel(self, value: object) -> None:
        from servelab.lora.kernels import get_lora_kernel
        device = next(iter(self.layers.values())).lora_a.device if self.layers else "cpu"
        self.state.kernel = get_lora_kernel(value, device)

    # ---- the host cache -----------------------------------------------------------------

    def _check_consistent(self, request: LoRARequest) -> None:
        known = self._known.get(request.lora_name)
        if known is not None and known != request:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is already registered as {known!r}; one name "
                             f"cannot name another adapter ({request!r})")
        for other in self._known.values():
            if other.lora_int_id == request.lora_int_id and other.lora_name != request.lora_name:
                raise ValueError(f"lora_int_id={request.lora_int_id} of adapter {request.lora_name!r} is already "
                                 f"adapter {other.lora_name!r}'s; ids must be unique per adapter")

    def add_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter on the host, loaded (and validated) if it is not: ``ValueError``
        naming the adapter when it cannot be; ``RuntimeError`` when every host entry is pinned."""
        self._check_consistent(request)
        name = request.lora_name
        adapter = self._host.get(name)
        if adapter is not None:
            self._host.move_to_end(name)
            return adapter
        start = time.perf_counter()
        adapter = self.loader(request, max_rank=self.max_lora_rank, modules=self.modules)
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - start
        while len(self._host) >= self.max_cpu_loras:
            self._evict_host(name)
        self._host[name] = adapter
        self._known[name] = request
        return adapter

    def _evict_host(self, wanted: str) -> None:
        unpinned = [n for n in self._host if not self._pins[n]]
        inactive = [n for n in unpinned if n not in self._slot_of]
        victims = inactive or unpinned
        if not victims:
            raise RuntimeError(f"No free host lora slots for adapter {wanted!r}: all max_cpu_loras="
                               f"{self.max_cpu_loras} host adapters are pinned by running requests")
        victim = victims[0]
        if victim in self._slot_of:
            self.deactivate_adapter(victim)
        del self._host[victim]
        self.stats.host_evictions += 1

    def remove_adapter(self, name: str) -> bool:
        """Forget an adapter (host and slot); False if unknown. A pinned one is refused (``ValueError``)."""
        if self._pins[name]:
            raise ValueError(f"LoRA adapter {name!r} is in use by {self._pins[name]} running request(s)")
        self.deactivate_adapter(name)
        self._known.pop(name, None)
        return self._host.pop(name, None) is not None

    def list_adapters(self) -> list[str]:
        """Adapters on the host, least recently used first."""
        return list(self._host)

    # ---- the device slots ------------------------------------------------------------------

    def activate_adapter(self, request: LoRARequest) -> int:
        """The adapter's slot, activating it (see the module docstring); ``RuntimeError`` when every
        slot is pinned, ``ValueError`` when the adapter cannot be loaded."""
        name = request.lora_name
        slot = self._slot_of.get(name)
        if slot is not None:
            self._slot_of.move_to_end(name)
            return slot
        if None in self.lora_index_to_id:
            slot = self.lora_index_to_id.index(None)
        else:
            victim = next((n for n in self._slot_of if not self._pins[n]), None)
            if victim is None:
                raise RuntimeError(f"No free lora slots for adapter {name!r}: all max_loras={self.max_loras} slots "
                                   f"hold pinned adapters ({', '.join(self._slot_of)})")
            slot = self._slot_of[victim]
            self.deactivate_adapter(victim)
            self.stats.slot_evictions += 1
        adapter = self.add_adapter(request)
        start = time.perf_counter()
        for layer in self.layers.values():
            layer.set_slot(slot, adapter.weights)
        self.stats.activations += 1
        self.stats.activate_seconds += time.perf_counter() - start
        self._slot_of[name] = slot
        self.lora_index_to_id[slot] = request.lora_int_id
        return slot

    def deactivate_adapter(self, name: str) -> bool:
        """Free the adapter's slot (its buffers zeroed); False if it is not active."""
        slot = self._slot_of.pop(name, None)
        if slot is None:
            return False
        for layer in self.layers.values():
            layer.clear_slot(slot)
        self.lora_index_to_id[slot] = None
        return True

    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    def active_adapters(self) -> list[str]:
        """Active adapters, least recently used first."""
        return list(self._slot_of)

    # ---- pins ---------------------------------------------------------------------------------

    def pin_adapter(self, name: str) -> None:
        """One more running request uses ``name``: never evicted until unpinned as often."""
        self._pins[name] += 1

    def unpin_adapter(self, name: str) -> None:
        if self._pins[name] <= 0:
            raise ValueError(f"LoRA adapter {name!r} is not pinned")
        self._pins[name] -= 1
        if not self._pins[name]:
            del self._pins[name]

    def pinned(self) -> dict[str, int]:
        return {n: c for n, c in self._pins.items() if c}
