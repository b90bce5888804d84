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
full layers): hashes are tagged per group, each group's blocks are stored
under their own keys and copied in that group's layers only, and an external
hit must be served by every group. A **sliding-window group stores only
window blocks** (:mod:`servelab.connectors.windows`: a prefix of ``L`` tokens
needs only the group's blocks covering its last ``window - 1`` tokens). Which
prefix ends: the **save points** of a request, computed when it ends —
``floor((p - 1) / a) * a`` and ``floor(p / a) * a`` for its prompt length
``p`` (the hit of the same prompt again, or of a prompt extending it) and
``floor(c / a) * a`` for its computed tokens ``c`` (the next turn of a
conversation), ``a`` the manager's ``hit_alignment``. Their window blocks are
copied (from the pool's prefix cache, before the next forward) whatever the
``save`` mode; a sliding block the pool evicts or commits is otherwise not
stored. A lookup takes the longest prefix that the full groups serve
contiguously *and* whose window every sliding group has; a hit elsewhere (a
shared prefix ending between save points) is served from the tier by the
full groups only up to the nearest save point. Loads copy only the window
blocks; the scheduler releases the group's other blocks of the range
uncommitted.

Counters: ``stats()`` — per tier blocks stored / evicted / hit, per KV-cache
group blocks and bytes stored, lookups and external hit tokens, loads and
failed loads, failed saves.
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
from servelab.connectors.windows import block_rows, group_hashes, group_views, longest_servable

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
        self.group_stored_blocks: list[int] = []
        self.group_stored_bytes: list[int] = []
        self.group_loaded_blocks: list[int] = []

    # ---- binding ---------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._views = group_views(kv_cache_manager)
        self._hybrid = getattr(kv_cache_manager, "groups", None) is not None
        self.group_stored_blocks = [0] * len(self._views)
        self.group_stored_bytes = [0] * len(self._views)
        self.group_loaded_blocks = [0] * len(self._views)
        pool = kv_cache_manager.block_pool
        pool.evict_listeners.append(self._on_pool_blocks)
        if self.save == "all":
            pool.cache_listeners.append(self._on_pool_blocks)

    def _on_pool_blocks(self, blocks: list[Any]) -> None:
        """Pool hook (never raises): these indexed blocks are saved before the next forward
        (a sliding-window group's blocks only at its requests' save points: ``request_finished``)."""
        for block in blocks:
            key = block.block_hash
            if key is not None and not any(key in tier for tier in self.tiers):
                group = self._group_of(key)
                if self._views[group].window_blocks is None:
                    self._pending_saves.append((key, block.block_id, group))

    def _group_of(self, key: bytes) -> int:
        return int.from_bytes(key[-2:], "little") if self._hybrid else 0

    # ---- scheduler side ----------------------------------------------------------------

    def _group_hashes(self, request: Any, g: int) -> Any:
        return group_hashes(self.kv_cache_manager, request, g)

    def _available(self, key: bytes) -> bool:
        return any(key in tier for tier in self.tiers) or any(k == key for k, _, _ in self._pending_saves)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` whose needed blocks every group finds in a tier."""
        self.num_lookups += 1
        hashes = [self._group_hashes(request, g) for g in range(len(self._views))]
        align = getattr(self.kv_cache_manager, "hit_alignment", self._views[0].block_size)
        end = longest_servable(self._views, hashes, self._available, num_computed_tokens,
                               request.num_tokens - 1, align)
        num = max(end - num_computed_tokens, 0)
        return num, self.async_load and num > 0

    def update_state_after_alloc(self, request: Any, block_ids: Any, num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        rows = block_rows(block_ids, len(self._views))
        start = request.num_computed_tokens
        blocks = []
        for g, view in enumerate(self._views):
            hashes = self._group_hashes(request, g)
            for i in view.needed(start, start + num_external_tokens):  # a sliding group: its window only
                blocks.append((hashes[i], rows[g][i], g))
        self._pending_loads.append(LoadJob(request.request_id, blocks, self.async_load))
        self.num_hit_tokens += num_external_tokens

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Queue the window blocks of a sliding-window group's save points (module docstring)
        that the pool still caches; they are copied before the next forward."""
        windows = [g for g, view in enumerate(self._views) if view.window_blocks is not None]
        if not windows:
            return False, None
        align = getattr(self.kv_cache_manager, "hit_alignment", self._views[0].block_size)
        p, c = request.num_prompt_tokens, min(request.num_computed_tokens, request.num_tokens)
        ends = {max(p - 1, 0) // align * align, p // align * align, c // align * align}
        pool = self.kv_cache_manager.block_pool
        for g in windows:
            hashes = self._group_hashes(request, g)
            wanted = sorted({i for end in ends for i in self._views[g].needed(0, end) if i < len(hashes)})
            for i in wanted:
                key = hashes[i]
                block = pool.get_cached_block(key)  # committed: its KV is written
                if block is not None and not self._available(key):
                    self._pending_saves.append((key, block.block_id, g))
        return False, None

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
                payload = [t.clone() for t in self._block_tensors(block_id, group)]
                fresh = not any(key in tier for tier in self.tiers)
                self._save(key, payload)
            except Exception:
                self.num_failed_saves += 1
                continue
            if fresh:
                self.group_stored_blocks[group] += 1
                self.group_stored_bytes[group] += sum(t.numel() * t.element_size() for t in payload)

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
            with torch.inference_mode():  # thread-local: the caches may be inference tensors
                ok = self._run_job(job)
            self._done.put((job.request_id, ok))

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
                self.group_loaded_blocks[group] += 1
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
        out.update(group_stored_blocks=list(self.group_stored_blocks), group_stored_bytes=list(self.group_stored_bytes),
                   group_loaded_blocks=list(self.group_loaded_blocks),
                   lookups=self.num_lookups, hit_tokens=self.num_hit_tokens, loads=self.num_loads,
                   failed_loads=self.num_failed_loads, failed_saves=self.num_failed_saves)
        return out
