"""``KVConnector``: the seam between the KV block pool and KV that lives elsewhere.

A connector moves KV blocks between the paged cache of one pipeline and an
outside store (a host-memory or disk tier, another pipeline). It has two
roles, each with vLLM v1's method names, and one object plays both in a
servelab ``Pipeline`` (the scheduler calls one half, the model runner the other):

**Scheduler side** (called by :class:`~servelab.scheduling.Scheduler`, never concurrently):

1. ``get_num_new_matched_tokens(request, num_computed_tokens)`` when a waiting
   request is considered for admission, after the local prefix-cache lookup
   (``num_computed_tokens`` tokens hit locally). Returns ``(n, load_async)``:
   ``n`` more tokens the connector can provide (block-aligned; the scheduler
   never takes the request's last token from it: that one is recomputed for
   its logits) and whether they load between steps (``True``: the request
   waits, holding its blocks, in ``WAITING_FOR_REMOTE_KVS`` until the worker
   reports the load finished; ``False``: the load happens before this step's
   forward). ``n = None``: ask again next step. Side-effect free; may be
   called several times for one request.
2. ``update_state_after_alloc(request, block_ids, num_external_tokens)`` once
   the scheduler holds blocks for those tokens (``block_ids``: the request's
   whole block-table rows, a tuple with one list per KV-cache group, a
   1-tuple for a single-group model; the external tokens are positions
   ``num_computed_tokens .. num_computed_tokens + num_external_tokens - 1``).
   The connector records the load it owes. For a hybrid manager, the
   scheduler has already released (null in ``block_ids``) a sliding-window
   group's blocks that the prefix ``num_computed_tokens + num_external_tokens``
   does not read; the connector writes the group's window blocks only
   (:mod:`servelab.connectors.windows`).
3. ``build_connector_meta(scheduler_output)`` once per ``schedule()``, last:
   the per-step :class:`KVConnectorMetadata` the worker side acts on. It
   resets the connector's per-step state.
4. ``request_finished(request, block_ids)`` exactly once when a request ends,
   before its blocks are freed (``block_ids``: per group, as above). Returns
   ``(delay_free, params)``: with ``delay_free`` the connector takes over
   freeing — the scheduler keeps the blocks (not findable anew, not reused)
   until the worker reports the request in ``finished_sending``; ``params``
   (or None) lands on the request (``Request.kv_transfer_params``) for the
   caller.

**Worker side** (called by the model runner, around each forward, every step
including steps that compute nothing):

- ``bind_connector_metadata(meta)`` first, ``clear_connector_metadata()`` last;
- ``handle_preemptions(meta)``: copy out what must be saved before this
  step's forward overwrites it (blocks the pool evicted this step);
- ``start_load_kv()``: start this step's loads (a thread for async ones; a
  synchronous load completes before the forward);
- ``wait_for_layer_load(layer)`` for every layer before the forward (servelab's
  forward is one call, so the runner waits for all layers up front; a
  connector that loads layer by layer can still overlap layer ``i+1`` with
  ``i``'s wait);
- after the forward ``save_kv_layer(layer, kv_layer, attn_metadata)`` per
  layer, then ``wait_for_save()``;
- on a step that computes nothing while ``has_pending_work()``,
  ``wait_for_any(timeout)`` first: block until a transfer completes (or the
  timeout), so an engine waiting only for KV sleeps instead of spinning;
- ``get_finished(finished_req_ids)`` last: a :class:`KVTransferResult` with the
  requests whose async sends completed (``finished_sending``), whose async loads
  completed (``finished_recving``) and, among those, whose load **failed**
  (``failed_recving``). A failed load still counts as finished, so a request
  never waits forever; the scheduler then recomputes it from its local prefix
  (it never reads the KV of a failed load). Results are reported once.

**Commit after compute.** Loaded blocks become findable by prefix lookup only
when the load is reported finished and not failed (async), or after the
step's forward succeeded (sync) — the pool's rule for computed blocks. A
request aborted while its load is in flight keeps its blocks until the load
is reported (the worker may still be writing them).

**Binding.** Before the first step the pipeline calls
``bind_kv_cache_manager(manager)`` (scheduler side; e.g. to hear about
evictions) and ``register_kv_caches(kv_caches, layer_groups)`` (worker side:
``kv_caches[layer]`` is a tuple of paged tensors ``[num_blocks, block_size,
...]``; ``layer_groups[g]`` the layer indices of KV-cache group ``g``).
A connector object serves one pipeline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["KVConnector", "KVConnectorMetadata", "KVTransferResult", "check_kv_connector"]


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (connectors subclass it).

    ``started`` is set by the model runner when it binds the metadata: a step
    rolled back before that (an interrupted ``schedule()``) never ran its
    work, and the connector must carry it into the next metadata — except
    synchronous loads, whose request was rolled back with the step."""

    step: int = 0
    started: bool = False


@dataclass
class KVTransferResult:
    """Transfers the worker side saw complete since the last report.

    ``failed_recving`` is a subset of ``finished_recving``: a failed load is
    finished (the request stops waiting) and must be recomputed."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving)


class KVConnector(ABC):
    """A KV connector, both roles (see the module docstring for the contract)."""

    name = "connector"

    def __init__(self) -> None:
        self._metadata: KVConnectorMetadata | None = None
        self.kv_cache_manager: Any = None
        self.kv_caches: Sequence[tuple[torch.Tensor, ...]] = ()
        self.layer_groups: list[list[int]] = []

    # ---- binding -----------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """The scheduler's KV cache manager (called once, before the first step)."""
        self.kv_cache_manager = kv_cache_manager

    def register_kv_caches(self, kv_caches: Sequence[tuple[torch.Tensor, ...]],
                           layer_groups: Sequence[Sequence[int]]) -> None:
        """The paged caches per layer and the layers of each KV-cache group (called once).

        A quantized cache's pages move with their in-page scales (``"token_head"``: the third and
        fourth tensors of a layer, indexed by block like the data); static per-layer scales
        (``"tensor"`` / ``"head"``: stride-0 views, :func:`servelab.blocks.kv_quant.is_static_scale`)
        are not in the pages and are left out here: a receiver reads moved pages with its own
        static scales, which must be the same calibration."""
        from servelab.blocks.kv_quant import is_static_scale

        self.kv_caches = [tuple(t for t in layer if not (t.dim() == 3 and is_static_scale(t))) for layer in kv_caches]
        self.layer_groups = [list(g) for g in layer_groups]

    # ---- scheduler side ------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``(tokens the connector can provide past num_computed_tokens, load_async)``."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        """Blocks are held for the external tokens: record the load."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's metadata for the worker side (resets per-step state)."""

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """A request ended: ``(the connector frees its blocks later, transfer params)``."""
        return False, None

    def has_pending_work(self) -> bool:
        """True while transfers are in flight (the pipeline keeps stepping to hear of them)."""
        return False

    # ---- worker side ------------------------------------------------------------------

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        """Save what this step's forward would overwrite (default: nothing)."""

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Start this step's loads into the paged cache."""

    def wait_for_layer_load(self, layer_name: int | str) -> None:
        """Block until ``layer_name``'s part of this step's synchronous loads is in place."""

    def save_kv_layer(self, layer_name: int | str, kv_layer: tuple[torch.Tensor, ...], attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Start saving one layer's KV of this step (default: nothing)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Finish (or hand off) this step's saves."""

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> KVTransferResult:
        """Transfers completed since the last call (see :class:`KVTransferResult`)."""

    def wait_for_any(self, timeout: float) -> None:
        """Block until a transfer completes or ``timeout`` seconds pass (default: return)."""

    def shutdown(self) -> None:
        """Stop background work (threads); idempotent."""


_SCHEDULER_METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                      "request_finished")
_WORKER_METHODS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished")


def check_kv_connector(obj: Any) -> None:
    """Raise ``TypeError`` naming what ``obj`` lacks to be a KV connector."""
    missing = [m for m in (*_SCHEDULER_METHODS, *_WORKER_METHODS, "bind_kv_cache_manager", "register_kv_caches",
                           "bind_connector_metadata", "clear_connector_metadata", "handle_preemptions")
               if not callable(getattr(obj, m, None))]
    if missing:
        raise TypeError(f"kv_connector {type(obj).__name__} lacks {missing}; subclass "
                        "servelab.connectors.KVConnector")
