"""``OffloadConnector`` (``"offload"``): a second (host memory) and third (disk) tier for KV blocks.

What goes down: blocks the pool **evicts** (by default; ``save="all"``: every
block the moment it is committed) are copied into the host tier, keyed by
their block hash, before the step's forward can overwrite them; what the
host tier evicts goes to the disk tier (``disk_dir``), and what the disk tier
evicts is gone. Each tier has its capacity (blocks) and its own eviction
policy (the pool's policies, :mod:`servelab.connectors.tiers`).

What comes back: when a waiting request's local prefix hit stops at block
``i`` and blocks ``i, i+1, ...`` of its hash chain are in a tier, the
scheduler takes those tokens as an external hit
(``get_num_new_matched_tokens``); the blocks are copied back into freshly
allocated pool blocks — asynchronously by a loader thread (default; the
request waits in ``WAITING_FOR_REMOTE_KVS``) or synchronously before the
forward (``async_load=False``). A load whose block went missing (a disk file
deleted, a read error) fails: the request recomputes; the tier entry is dropped.

Hybrid models (several KV-cache groups, e.g. Gemma 2's sliding-window and
full layers): hashes are tagged per group, each group's evicted blocks are
offloaded under their own keys and copied in that group's layers only, and an
external hit must be served by every group. Loaded blocks are committed
(findable) afterwards, so a sliding-window group must load **every** block of
the external range, not only those its window reads: a committed block must
hold real KV. (Offloading only the window's blocks would need the manager to
leave out-of-window positions uncommitted; not done.)

Counters: ``stats()`` — per tier blocks stored / evicted / hit, lookups and
external hit tokens, loads and failed loads, failed saves.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from servelab._internal.validation import check_int
from servelab.connectors.base import KVConnector, KVConnectorMetadata, KVTransferResult
from servelab.connectors.tiers import TierStore

__all__ = ["LoadJob", "OffloadConnector", "OffloadMetadata"]

_SAVE_MODES = ("evicted", "all")


@dataclass
class LoadJob:
    """Blocks to copy into the pool for one request: ``(key, block id, group)`` each."""

    request_id: str
    blocks: list[tuple[bytes, int, int]]
    load_async: bool


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    """One step's work: ``saves`` ``(key, block id, group)`` copied out before the forward, ``loads``."""

    saves: list[tuple[bytes, int, int]] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)


class OffloadConnector(KVConnector):
    """See the module docstring.

    Args:
        cpu_blocks: host-tier capacity in blocks.
        disk_dir: a folder for the disk tier (None: no disk tier).
        disk_blocks: disk-tier capacity in blocks (needs ``disk_dir``).
        eviction_policy: each tier's eviction policy (a registered name).
        save: ``"evicted"`` (blocks the pool evicts) or ``"all"`` (every committed block).
        async_load: load on a thread while the request waits (True) or before the forward (False).
    """

    name = "offload"

    def __init__(self, *, cpu_blocks: int = 1024, disk_dir: str | os.PathLike | None = None, disk_blocks: int = 0,
                 eviction_policy: str = "lru", save: str = "evicted", async_load: bool = True) -> None:
        super().__init__()
        check_int("cpu_blocks", cpu_blocks, min_value=1)
        check_int("disk_blocks", disk_blocks, min_value=0)
        if save not in _SAVE_MODES:
            raise ValueError(f"save={save!r}; valid: {_SAVE_MODES}")
        if disk_blocks and disk_dir is None:
            raise ValueError(f"disk_blocks={disk_blocks} needs disk_dir (a folder for the disk tier)")
        self.tiers = [TierStore("host", cpu_blocks, eviction_policy)]
        if disk_dir is not None and disk_blocks:
            self.tiers.append(TierStore("disk", disk_blocks, eviction_policy, directory=disk_dir))
        self.save, self.async_load = save, async_load
        self._pending_saves: list[tuple[bytes, int, int]] = []
        self._pending_loads: list[LoadJob] = []
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (request id, ok) from the loader
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._inflight = 0
        self._sync_results: list[tuple[str, bool]] = []
        self._last_meta: OffloadMetadata | None = None
        self.num_lookups = 0
        self.num_hit_tokens = 0
        self.num_loads = 0
        self.num_failed_loads = 0
        self.num_failed_saves = 0

    # ---- binding ---------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        groups = getattr(kv_cache_manager, "groups", None)
        self._group_specs = [g.spec for g in groups] if groups is not None else [kv_cache_manager.spec]
        self._hybrid = groups is not None
        pool = kv_cache_manager.block_pool
        pool.evict_listeners.append(self._on_pool_blocks)
        if self.save == "all":
            pool.cache_listeners.append(self._on_pool_blocks)

    def _on_pool_blocks(self, blocks: list[Any]) -> None:
        """Pool hook (never raises): these indexed blocks are saved before the next forward."""
        for block in blocks:
            key = block.block_hash
            if key is not None and not any(key in tier for tier in self.tiers):
                self._pending_saves.append((key, block.block_id, self._group_of(key)))

    def _group_of(self, key: bytes) -> int:
        return int.from_bytes(key[-2:], "little") if self._hybrid else 0

    # ---- scheduler side ----------------------------------------------------------------

    def _group_hashes(self, request: Any, g: int) -> Any:
        if self._hybrid:
            return self.kv_cache_manager.group_hashes(request, g)
        return request.block_hashes

    def _available(self, key: bytes) -> bool:
        return any(key in tier for tier in self.tiers) or any(k == key for k, _, _ in self._pending_saves)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` whose blocks every group finds in a tier."""
        self.num_lookups += 1
        end = request.num_tokens - 1
        for g, spec in enumerate(self._group_specs):
            bs = spec.block_size
            hashes = self._group_hashes(request, g)
            i = num_computed_tokens // bs
            limit = min(len(hashes), end // bs)
            while i < limit and self._available(hashes[i]):
                i += 1
            end = min(end, i * bs)
        align = getattr(self.kv_cache_manager, "hit_alignment", self._group_specs[0].block_size)
        num = max(end // align * align - num_computed_tokens, 0)
        return num, self.async_load and num > 0

    def update_state_after_alloc(self, request: Any, block_ids: Any, num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        rows = block_ids  # one list per KV-cache group
        start = request.num_computed_tokens
        blocks = []
        for g, spec in enumerate(self._group_specs):
            bs, hashes = spec.block_size, self._group_hashes(request, g)
            for i in range(start // bs, (start + num_external_tokens) // bs):
                blocks.append((hashes[i], rows[g][i], g))
        self._pending_loads.append(LoadJob(request.request_id, blocks, self.async_load))
        self.num_hit_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> OffloadMetadata:
        last = self._last_meta
        if last is not None and not last.started:  # that step was rolled back before it ran
            self._pending_saves[:0] = last.saves  # no forward ran since: the blocks are intact
            self._pending_loads[:0] = [job for job in last.loads if job.load_async]  # still parked
        meta = OffloadMetadata(step=scheduler_output.step, saves=self._pending_saves, loads=self._pending_loads)
        self._pending_saves, self._pending_loads = [], []
        self._last_meta = meta
        return meta

    def has_pending_work(self) -> bool:
        return self._inflight > 0 or not self._done.empty()

    # ---- worker side ----------------------------------------------------------------------

    def _block_tensors(self, block_id: int, group: int) -> list[torch.Tensor]:
        """Views of block ``block_id`` in every tensor of the group's layers."""
        return [t[block_id] for layer in self.layer_groups[group] for t in self.kv_caches[layer]]

    def handle_preemptions(self, metadata: Any) -> None:
        """Copy this step's evicted (or committed) blocks into the host tier, before the
        forward overwrites them. A failing save loses that block's copy, nothing else."""
        if metadata is None:
            return
        for key, block_id, group in metadata.saves:
            try:
                self._save(key, [t.clone() for t in self._block_tensors(block_id, group)])
            except Exception:
                self.num_failed_saves += 1

    def _save(self, key: bytes, payload: list[torch.Tensor]) -> None:
        """Store into the host tier; its evictions cascade down the tiers."""
        spill = [(key, payload)]
        for tier in self.tiers:
            spill = [ev for k, p in spill for ev in tier.put(k, p) if ev[1]]
            if not spill:
                break

    def start_load_kv(self, **kwargs: Any) -> None:
        metadata = self._metadata
        if not isinstance(metadata, OffloadMetadata):
            return
        for job in metadata.loads:
            self.num_loads += 1
            if job.load_async:
                self._inflight += 1
                self._ensure_thread()
                self._jobs.put(job)
            else:
                self._sync_results.append((job.request_id, self._run_job(job)))

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loader, name="servelab-offload-loader", daemon=True)
            self._thread.start()

    def _loader(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._done.put((job.request_id, self._run_job(job)))

    def _run_job(self, job: LoadJob) -> bool:
        """Copy a job's blocks into the pool; False (and the bad entries dropped) if any is missing."""
        try:
            for key, block_id, group in job.blocks:
                payload = self._read(key)
                targets = self._block_tensors(block_id, group)
                if payload is None or len(payload) != len(targets):
                    return False
                for dst, src in zip(targets, payload):
                    dst.copy_(src)
            return True
        except Exception:
            return False

    def _read(self, key: bytes) -> list[torch.Tensor] | None:
        for tier in self.tiers:
            payload = tier.get(key)
            if payload is not None:
                return payload
        return None

    def wait_for_any(self, timeout: float) -> None:
        if self._inflight and self._done.empty():
            try:
                self._done.put(self._done.get(timeout=timeout))
            except queue.Empty:
                pass

    def wait_for_save(self) -> None:
        """Saves are synchronous copies (done in ``handle_preemptions``)."""

    def get_finished(self, finished_req_ids: set[str]) -> KVTransferResult:
        result = KVTransferResult()
        done = list(self._sync_results)
        self._sync_results.clear()
        while not self._done.empty():
            done.append(self._done.get())
            self._inflight -= 1
        for rid, ok in done:
            result.finished_recving.add(rid)
            if not ok:
                result.failed_recving.add(rid)
                self.num_failed_loads += 1
        return result

    def shutdown(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=5)
        self._thread = None

    # ---- reports -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Per tier: blocks held, stored, evicted, hit (loaded back), failed reads; and totals."""
        out: dict[str, Any] = {t.name: dict(blocks=len(t), stored=t.stats.stored, evicted=t.stats.evicted,
                                            hits=t.stats.hits, failed_reads=t.stats.failed_reads)
                               for t in self.tiers}
        out.update(lookups=self.num_lookups, hit_tokens=self.num_hit_tokens, loads=self.num_loads,
                   failed_loads=self.num_failed_loads, failed_saves=self.num_failed_saves)
        return out
