"""Requests and their adapters in a pipeline: the glue between the pipeline,
the model runner and the :class:`~servelab.lora.manager.LoRAModelManager`.

- ``add_request(rid, lora_request)``: the adapter is loaded and validated now
  (a bad one fails that request when it is added, naming the adapter);
- ``begin_step(req_ids, num_rows)``: the runner, before each forward: each
  scheduled request's adapter is activated (pinned while its request runs),
  and the wrapped layers get the step's :class:`~servelab.lora.kernels.LoRAMapping`;
  an adapter that can no longer be loaded (its folder removed since) fails its
  requests only (returned as errors; their rows run without it and are discarded);
- ``end_step()``: the mapping is cleared after the forward;
- ``detach(rid)`` (preempted or ended: unpinned) and ``release(rid)`` (ended: forgotten).
"""

from __future__ import annotations

from servelab.lora.kernels import LoRAMapping
from servelab.lora.manager import LoRAModelManager
from servelab.lora.request import LoRARequest

__all__ = ["LoRAServing"]


class LoRAServing:
    """Per-request adapter bookkeeping of one pipeline (see the module docstring)."""

    def __init__(self, manager: LoRAModelManager) -> None:
        self.manager = manager
        self._adapter_of: dict[str, LoRARequest] = {}
        self._running: set[str] = set()  # request ids holding a pin on their adapter

    def add_request(self, request_id: str, lora_request: LoRARequest) -> None:
        """Load and validate the adapter (``ValueError`` naming it), then remember it for the request."""
        self.manager.add_adapter(lora_request)
        self._adapter_of[request_id] = lora_request

    def adapter_of(self, request_id: str) -> LoRARequest | None:
        return self._adapter_of.get(request_id)

    def begin_step(self, req_ids: list[str], num_rows: list[int]) -> dict[str, str]:
        """Activate the step's adapters and set the mapping; returns ``{request id: error}``
        for requests whose adapter could not be activated."""
        manager = self.manager
        errors: dict[str, str] = {}
        slots: list[int] = []
        for rid in req_ids:
            request = self._adapter_of.get(rid)
            if request is None:
                slots.append(-1)
                continue
            if rid not in self._running:
                manager.pin_adapter(request.lora_name)
                self._running.add(rid)
            try:
                slots.append(manager.activate_adapter(request))
            except (ValueError, RuntimeError) as exc:
                errors[rid] = str(exc)
                slots.append(-1)
        device = next(iter(manager.layers.values())).lora_a.device if manager.layers else "cpu"
        manager.state.mapping = LoRAMapping.from_requests(slots, num_rows, device)
        return errors

    def end_step(self) -> None:
        self.manager.state.mapping = None

    def detach(self, request_id: str) -> None:
        """The request stopped running (preempted, rolled back or ended): its pin is released."""
        if request_id in self._running:
            self._running.discard(request_id)
            self.manager.unpin_adapter(self._adapter_of[request_id].lora_name)

    def release(self, request_id: str) -> None:
        """The request ended: unpinned and forgotten (idempotent)."""
        self.detach(request_id)
        self._adapter_of.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._adapter_of)
