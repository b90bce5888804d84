"""servelab's host-tier offload as a vLLM v1 KV connector.

Load it in vLLM with::

    from vllm.config import KVTransferConfig
    KVTransferConfig(kv_connector="ServelabOffloadConnector",
                     kv_connector_module_path="servelab.integrations.vllm.kv_connector",
                     kv_role="kv_both", kv_connector_extra_config={"cpu_blocks": 4096, "eviction_policy": "lru"})

**Scheduler side** (the part differential-tested on CPU against vLLM's real
``Scheduler``): a host tier *index* — a :class:`~servelab.connectors.tiers.TierStore`
of block hashes with ``cpu_blocks`` capacity and one of servelab's eviction
policies; the tensors live on the worker. When a request finishes,
``request_finished`` offloads its computed full blocks not yet in the tier:
it takes over freeing them (delayed free) and the next step's metadata asks
the worker to copy them to host memory; the worker reports the request in
``finished_sending`` once copied, and vLLM frees the blocks. A waiting
request whose local prefix hit stops at block ``i`` while blocks ``i, i+1,
...`` of its hash chain are in the tier gets them as an external hit
(``get_num_new_matched_tokens``; asynchronous: vLLM parks it in
``WAITING_FOR_REMOTE_KVS``); ``update_state_after_alloc`` records the copy
into the blocks vLLM allocated; the worker reports ``finished_recving`` (or
``failed_recving`` if a block was missing: vLLM then recomputes). Tier
evictions are sent to the worker so it drops those tensors.

**Worker side** (runs in the GPU script, ``bench/gpu/vllm_integration.py``;
on CPU with fake caches in the tests): host copies keyed by hash; per step,
drops evicted entries, copies stores out (before the forward: the blocks are
held by the delayed free), copies loads in, and reports both in
``get_finished``. Block tensors are addressed on the block dimension of each
layer's cache (dimension 1 for a ``[2, num_blocks, ...]`` K/V stack, else 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servelab.integrations.vllm._compat import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from servelab.connectors.tiers import TierStore  # noqa: E402

__all__ = ["ServelabOffloadConnector", "ServelabOffloadMetadata"]


@dataclass
class ServelabOffloadMetadata(KVConnectorMetadata):
    """One step: ``evict`` host keys to drop, ``stores`` (request id, [(key, block id)]) to copy
    out, ``loads`` (request id, [(key, block id)]) to copy in (in that order)."""

    evict: list[bytes] = field(default_factory=list)
    stores: list[tuple[str, list[tuple[bytes, int]]]] = field(default_factory=list)
    loads: list[tuple[str, list[tuple[bytes, int]]]] = field(default_factory=list)


class ServelabOffloadConnector(KVConnectorBase_V1):
    """See the module docstring. ``kv_connector_extra_config``: ``cpu_blocks`` (default
    1024), ``eviction_policy`` (a servelab eviction policy name, default ``"lru"``)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = vllm_config.cache_config.block_size
        self.cpu_blocks = int(extra.get("cpu_blocks", 1024))
        # scheduler side
        self.tier = TierStore("host", self.cpu_blocks, extra.get("eviction_policy", "lru"))
        self._lookups: dict[str, tuple[int, int]] = {}  # request id -> (first block, blocks) last offered
        self._meta = ServelabOffloadMetadata()
        self._loading: dict[str, list[bytes]] = {}  # request id -> keys of its load in flight
        self._no_external: set[str] = set()  # a failed load: recomputed, never offered again
        self.num_hit_tokens = 0
        self.num_offloaded_blocks = 0
        # worker side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.host: dict[bytes, list[torch.Tensor]] = {}
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()

    # ---- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.request_id in self._no_external:
            return 0, False
        hashes = request.block_hashes
        start = num_computed_tokens // self.block_size
        limit = min(len(hashes), (request.num_tokens - 1) // self.block_size)  # the last token is computed
        end = start
        while end < limit and hashes[end] in self.tier:
            end += 1
        if end == start:
            return 0, False
        self._lookups[request.request_id] = (start, end - start)
        return (end - start) * self.block_size, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        offered = self._lookups.pop(request.request_id, None)
        if not num_external_tokens or offered is None:
            return
        start, n = offered
        n = min(n, num_external_tokens // self.block_size)
        block_ids = blocks.get_block_ids()[0]
        hashes = request.block_hashes
        pairs = [(bytes(hashes[i]), block_ids[i]) for i in range(start, start + n)]
        for key, _ in pairs:
            self.tier.get(key)  # a hit: most recently used
        self._meta.loads.append((request.request_id, pairs))
        self._loading[request.request_id] = [key for key, _ in pairs]
        self.num_hit_tokens += n * self.block_size

    def update_connector_output(self, connector_output: Any) -> None:
        """A failed load's keys leave the index (the worker lost them); its request recomputes."""
        for rid in getattr(connector_output, "failed_recving", None) or ():
            self._no_external.add(rid)
            for key in self._loading.pop(rid, ()):
                self.tier.discard(key)
                self._meta.evict.append(key)
        for rid in connector_output.finished_recving or ():
            self._loading.pop(rid, None)

    def build_connector_meta(self, scheduler_output: Any) -> ServelabOffloadMetadata:
        meta, self._meta = self._meta, ServelabOffloadMetadata()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Offload the request's computed full blocks not yet in the tier (delayed free until copied)."""
        self._lookups.pop(request.request_id, None)
        self._no_external.discard(request.request_id)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes), len(block_ids))
        pairs = []
        for i in range(num_full):
            key = bytes(request.block_hashes[i])
            if key in self.tier:
                continue
            for old_key, _ in self.tier.put(key, []):
                self._meta.evict.append(old_key)
            pairs.append((key, block_ids[i]))
        if not pairs:
            return False, None
        self._meta.stores.append((request.request_id, pairs))
        self.num_offloaded_blocks += len(pairs)
        return True, None

    # ---- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = dict(kv_caches)

    def _block(self, cache: torch.Tensor, block_id: int) -> torch.Tensor:
        return cache[:, block_id] if cache.dim() >= 3 and cache.shape[0] == 2 else cache[block_id]

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Drop evicted entries, copy stores out, then loads in (synchronous copies)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, ServelabOffloadMetadata):
            return
        for key in meta.evict:
            self.host.pop(key, None)
        for rid, pairs in meta.stores:
            for key, block_id in pairs:
                self.host[key] = [self._block(c, block_id).to("cpu", copy=True) for c in self.kv_caches.values()]
            self._finished_sending.add(rid)
        for rid, pairs in meta.loads:
            ok = True
            for key, block_id in pairs:
                payload = self.host.get(key)
                if payload is None:
                    ok = False
                    break
                for cache, src in zip(self.kv_caches.values(), payload):
                    self._block(cache, block_id).copy_(src, non_blocking=True)
            self._finished_recving.add(rid)
            if not ok:
                self._failed_recving.add(rid)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in ``start_load_kv``."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves happen at request end (``request_finished``), not per layer."""

    def wait_for_save(self) -> None:
        """Stores complete in ``start_load_kv``."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, self._finished_sending = self._finished_sending, set()
        recving, self._finished_recving = self._finished_recving, set()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving, self._failed_recving = set(self._failed_recving), set()
        return results
