"""``PDConnector`` (``"pd"``): prefill on one pipeline, decode on another.

Two pipelines over the same model, each with a ``PDConnector`` on the same
channel (:mod:`servelab.connectors.channels`):

- the **producer** (``role="producer"``) runs the prompt and samples the first
  token (``max_tokens=1``). It **publishes** the request's KV on the channel
  under a lease — when the request ends normally (``publish_at="end"``), or
  already once its prompt's blocks are committed (``publish_at="prefill"``:
  the request may go on decoding, and may be preempted, while a consumer
  pulls). ``request_finished`` returns the transfer params ``{"transfer_id",
  "num_blocks", "token_ids"}`` (``token_ids``: prompt + first token, the
  request state the decode side continues from).
- **Leases hold their own block references.** Publishing takes one pool
  reference on every published block; the transfer releases it when the
  consumer confirms or the lease expires (settled on the producer's scheduler
  side, each step). Whatever happens to the request meanwhile — it ends, is
  preempted and recomputes, fails, is aborted — the published blocks are
  never reused while a pull may read them (*prefer leaking to misusing*: an
  unconfirmed transfer costs its blocks until the lease runs out). A request
  that ends failed or aborted revokes its own early transfer.
- the **consumer** (``role="consumer"``) gets a request whose
  ``SamplingParams.extra_args["kv_transfer_params"]`` are the producer's params
  (and whose prompt is ``token_ids``). Its scheduler asks for an external hit:
  the blocks whose hashes match the request's own hashes (checked block by
  block: KV for other tokens is never used); they load on a thread while the
  request waits for remote KV; then it confirms. A transfer that is gone
  (lease expired, channel lost, a read error) fails the load: the consumer
  recomputes the prompt itself, never reads wrong KV.

**Hybrid models** (several KV-cache groups, e.g. Gemma 2): a transfer is a flat
list of per-group blocks, each named by its group-tagged hash; a full-attention
group sends every block of the prefix, a sliding-window group only the blocks
its window reads at the prefix end (:mod:`servelab.connectors.windows`). The
prefix sent is the longest block-aligned one (``hit_alignment``) whose needed
blocks the producer still holds.

:func:`disaggregated_generate` runs a batch this way and returns the outputs
a single pipeline would (greedy: token for token).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from servelab._internal.validation import check_number
from servelab.connectors.base import KVConnector, KVConnectorMetadata, KVTransferResult
from servelab.connectors.channels import TransferChannel
from servelab.connectors.windows import block_rows, group_hashes, group_views, longest_servable

__all__ = ["PDConnector", "PDMetadata", "disaggregated_generate"]

_ROLES = ("producer", "consumer")
_PUBLISH_AT = ("end", "prefill")

# A pull: (request id, transfer id, [(entry index in the transfer, block id, group)] or None: fails)
Load = tuple[str, str, "list[tuple[int, int, int]] | None"]


@dataclass
class PDMetadata(KVConnectorMetadata):
    """``loads``: the transfers to pull this step (see ``Load``)."""

    loads: list[Load] = field(default_factory=list)


class PDConnector(KVConnector):
    """See the module docstring.

    Args:
        role: ``"producer"`` (prefill) or ``"consumer"`` (decode).
        channel: a :class:`~servelab.connectors.channels.TransferChannel` shared by both sides.
        lease_s: how long the producer holds published blocks without a confirmation.
        publish_at: producer: ``"end"`` (when the request ends) or ``"prefill"`` (once its
            prompt's blocks are committed).
    """

    name = "pd"

    def __init__(self, role: str, channel: TransferChannel, *, lease_s: float = 30.0,
                 publish_at: str = "end") -> None:
        super().__init__()
        if role not in _ROLES:
            raise ValueError(f"role={role!r}; valid: {_ROLES}")
        if publish_at not in _PUBLISH_AT:
            raise ValueError(f"publish_at={publish_at!r}; valid: {_PUBLISH_AT}")
        if not callable(getattr(channel, "publish", None)) or not callable(getattr(channel, "pull", None)):
            raise TypeError(f"channel must be a TransferChannel (publish, describe, pull, confirm, settle), "
                            f"got {type(channel).__name__}")
        self.role, self.channel, self.publish_at = role, channel, publish_at
        self.lease_s = check_number("lease_s", lease_s, min_value=0.0)
        self._loads: list[Load] = []
        self._leases: dict[str, list[Any]] = {}  # producer: transfer id -> the blocks it holds a reference on
        self._watch: dict[str, Any] = {}  # producer, publish_at="prefill": requests not yet published
        self._params: dict[str, dict[str, Any]] = {}
        self._pulled: set[str] = set()  # consumer: transfers it loaded (or tried to)
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight = 0
        self._last_meta: PDMetadata | None = None
        self.num_sent = self.num_received = self.num_failed_loads = self.num_expired = 0
        self.bytes_published = 0
        self.group_sent_blocks: list[int] = []

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._views = group_views(kv_cache_manager)
        self.block_size = kv_cache_manager.block_size
        self.align = getattr(kv_cache_manager, "hit_alignment", self.block_size)
        self.group_sent_blocks = [0] * len(self._views)

    def _block_tensors(self, block_id: int, group: int) -> list[torch.Tensor]:
        return [t[block_id] for layer in self.layer_groups[group] for t in self.kv_caches[layer]]

    def _hashes(self, request: Any) -> list[Sequence[bytes]]:
        return [group_hashes(self.kv_cache_manager, request, g) for g in range(len(self._views))]

    def transfer_params(self, request_id: str) -> dict[str, Any] | None:
        """Producer: the params of an ended request (popped), to hand to the consumer."""
        return self._params.pop(request_id, None)

    # ---- scheduler side -----------------------------------------------------------------

    @staticmethod
    def _request_params(request: Any) -> dict[str, Any] | None:
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        params = extra.get("kv_transfer_params")
        return params if isinstance(params, dict) and "transfer_id" in params else None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.role != "consumer":
            if self.publish_at == "prefill" and request.request_id not in self._leases:
                self._watch[request.request_id] = request  # published by build_connector_meta once committed
            return 0, False
        params = self._request_params(request)
        if params is None or params["transfer_id"] in self._pulled:
            return 0, False
        hashes = self.channel.describe(params["transfer_id"])
        if not hashes:
            return 0, False
        sent = set(hashes)  # chained hashes: a match names exactly this request's tokens up to that block
        end = longest_servable(self._views, self._hashes(request), sent.__contains__, num_computed_tokens,
                               request.num_tokens - 1, self.align)
        num = end - num_computed_tokens
        return (num, True) if num > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: Any, num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        params = self._request_params(request)
        if params is None:
            return
        tid = params["transfer_id"]
        index = {h: k for k, h in enumerate(self.channel.describe(tid) or ())}
        rows, mine = block_rows(block_ids, len(self._views)), self._hashes(request)
        start = request.num_computed_tokens
        pairs: list[tuple[int, int, int]] | None = []
        for g, view in enumerate(self._views):
            for i in view.needed(start, start + num_external_tokens):
                k = index.get(mine[g][i])
                if k is None or pairs is None:  # the transfer went away since the lookup: the load fails
                    pairs = None
                    break
                pairs.append((k, rows[g][i], g))
        self._pulled.add(tid)
        self._loads.append((request.request_id, tid, pairs))

    def build_connector_meta(self, scheduler_output: Any) -> PDMetadata:
        last = self._last_meta
        if last is not None and not last.started:  # that step was rolled back before it ran
            self._loads[:0] = last.loads  # the requests are still parked, holding their blocks
        meta = PDMetadata(step=scheduler_output.step, loads=self._loads)
        self._loads = []
        self._last_meta = meta
        if self.role == "producer":
            self._settle()
            self._publish_committed_prompts()
        return meta

    def _settle(self) -> None:
        """Release the references of transfers confirmed or expired (now revoked: no pull reads them)."""
        if not self._leases:
            return
        pool = self.kv_cache_manager.block_pool
        for tid in self.channel.settle(sorted(self._leases)):
            pool.free_blocks(self._leases.pop(tid)[::-1])

    def _publish_committed_prompts(self) -> None:
        """``publish_at="prefill"``: publish the requests whose prompt blocks are committed."""
        for rid, request in list(self._watch.items()):
            committed = request.num_committed_blocks * self.block_size  # 0 again after a preemption
            prompt_end = request.num_prompt_tokens // self.align * self.align
            if prompt_end == 0 or committed < prompt_end:
                continue
            del self._watch[rid]
            try:
                rows = block_rows(self.kv_cache_manager.get_block_ids(request), len(self._views))
                self._publish(request, rows, prompt_end)
            except Exception:
                pass  # not published now: request_finished tries again

    def _publish(self, request: Any, rows: tuple[list[int], ...], num_tokens: int) -> int:
        """Publish, under a lease holding its own references, the blocks that the longest
        prefix of at most ``num_tokens`` tokens needs and ``rows`` still holds (a sliding
        group may have released old ones). Returns the prefix length (0: nothing sent)."""
        pool = self.kv_cache_manager.block_pool
        end = num_tokens // self.align * self.align
        entries: list[tuple[int, int]] = []
        while end > 0:
            entries = [(g, i) for g, view in enumerate(self._views) for i in view.needed(0, end)]
            if all(i < len(rows[g]) and not pool.blocks[rows[g][i]].is_null for g, i in entries):
                break
            end -= self.align
        if end == 0:
            return 0
        hashes = self._hashes(request)
        blocks = [pool.blocks[rows[g][i]] for g, i in entries]
        groups = [g for g, _ in entries]
        tid = request.request_id
        pool.touch(blocks)  # the lease's references: the blocks outlive the request if need be
        try:
            self.channel.publish(tid, [hashes[g][i] for g, i in entries],
                                 lambda k: self._block_tensors(blocks[k].block_id, groups[k]), self.lease_s)
        except BaseException:
            pool.free_blocks(blocks[::-1])
            raise
        self._leases[tid] = blocks
        self.num_sent += 1
        for g in groups:
            self.group_sent_blocks[g] += 1
        self.bytes_published += sum(t.numel() * t.element_size() for k in range(len(blocks))
                                    for t in self._block_tensors(blocks[k].block_id, groups[k]))
        return end

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        tid = request.request_id
        if self.role == "consumer":
            params = self._request_params(request)
            if params is not None and params["transfer_id"] not in self._pulled:
                self.channel.confirm(params["transfer_id"])  # it will not pull: release the producer early
            return False, None
        self._watch.pop(tid, None)
        if request.status.finish_reason not in ("length", "stop"):
            if tid in self._leases:  # failed or aborted after an early publish: nothing to hand over
                self.channel.confirm(tid)
            return False, None
        if tid not in self._leases:
            rows = block_rows(block_ids, len(self._views))
            if not self._publish(request, rows, min(request.num_computed_tokens, request.num_tokens)):
                return False, None
        params = {"transfer_id": tid, "num_blocks": len(self._leases[tid]), "token_ids": list(request.all_token_ids)}
        self._params[tid] = params
        return False, params  # the lease holds its own references: the request's blocks are freed now

    def has_pending_work(self) -> bool:
        return bool(self._leases) or self._inflight > 0

    # ---- worker side --------------------------------------------------------------------------

    def wait_for_save(self) -> None:
        """Nothing: the producer publishes on the scheduler side."""

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._metadata
        if not isinstance(meta, PDMetadata):
            return
        for rid, tid, pairs in meta.loads:
            self._inflight += 1
            threading.Thread(target=self._pull, args=(rid, tid, pairs), daemon=True,
                             name="servelab-pd-pull").start()

    def _pull(self, rid: str, tid: str, pairs: list[tuple[int, int, int]] | None) -> None:
        ok = False
        if pairs is not None:
            dst = {k: (block_id, g) for k, block_id, g in pairs}
            try:
                with torch.inference_mode():  # thread-local: the caches may be inference tensors
                    ok = self.channel.pull(tid, list(dst), lambda k: self._block_tensors(*dst[k]))
            except Exception:
                ok = False
        if ok:
            try:
                self.channel.confirm(tid)
            except Exception:
                pass  # the lease will expire
        self._done.put((rid, ok))

    def wait_for_any(self, timeout: float) -> None:
        if self._inflight and self._done.empty():
            try:
                self._done.put(self._done.get(timeout=timeout))
            except queue.Empty:
                pass
        elif self._leases:  # only leases pending: a short nap, then settle again
            time.sleep(min(timeout, 0.005))

    def get_finished(self, finished_req_ids: set[str]) -> KVTransferResult:
        result = KVTransferResult()
        while not self._done.empty():
            rid, ok = self._done.get()
            self._inflight -= 1
            result.finished_recving.add(rid)
            if ok:
                self.num_received += 1
            else:
                result.failed_recving.add(rid)
                self.num_failed_loads += 1
        return result


def disaggregated_generate(prefill: Any, decode: Any, prompts: Sequence[Any], sampling_params: Any) -> list[Any]:
    """Prefill on ``prefill`` (a pipeline with a producer ``PDConnector``), decode on ``decode``
    (a consumer on the same channel), interleaved: a request is handed to the decode pipeline
    as soon as its prefill ends, and both pipelines step in turn (so the producer's held
    blocks are confirmed and freed while other prefills still need room). Returns one output
    per prompt, in order: ``token_ids`` the first token (from the prefill) followed by the
    decode's; ``prompt_token_ids`` the prompt."""
    producer = prefill.kv_connector
    if not isinstance(producer, PDConnector) or producer.role != "producer":
        raise ValueError("prefill must be a Pipeline whose kv_connector is a PDConnector(role='producer')")
    if not isinstance(decode.kv_connector, PDConnector) or decode.kv_connector.role != "consumer":
        raise ValueError("decode must be a Pipeline whose kv_connector is a PDConnector(role='consumer')")
    first = dataclasses.replace(sampling_params, max_tokens=1)
    index = {prefill.add_request(p, first, index=i): i for i, p in enumerate(prompts)}
    results: list[Any] = [None] * len(prompts)
    in_decode: dict[str, int] = {}
    while index or in_decode:
        for event in prefill.step() if index else ():
            if event.finished and event.request_id in index:
                i = index.pop(event.request_id)
                out = results[i] = prefill.get_output(event.request_id, pop=True)
                rid = _hand_over(producer, decode, out, sampling_params)
                if rid is not None:
                    in_decode[rid] = i
        for event in decode.step() if in_decode else ():
            if event.finished and event.request_id in in_decode:
                out = decode.get_output(event.request_id, pop=True)
                done = results[in_decode.pop(event.request_id)]
                done.token_ids = list(done.token_ids) + list(out.token_ids)
                done.text += out.text
                done.finish_reason, done.stop_reason, done.error = out.finish_reason, out.stop_reason, out.error
    prefill.step()  # the producer settles the last confirmations and frees those blocks
    return results


def _hand_over(producer: PDConnector, decode: Any, out: Any, sampling_params: Any) -> str | None:
    """Queue the decode of a finished prefill (its id), or None when it ended at its first token."""
    handoff = producer.transfer_params(out.request_id)
    if out.finish_reason != "length" or sampling_params.max_tokens <= 1:
        if handoff is not None:  # nothing to decode (stop, error, max_tokens=1): release the blocks now
            producer.channel.confirm(handoff["transfer_id"])
        return None
    extra = dict(sampling_params.extra_args or {})
    if handoff is not None:
        extra["kv_transfer_params"] = handoff
    params = dataclasses.replace(sampling_params, max_tokens=sampling_params.max_tokens - 1, extra_args=extra)
    return decode.add_request(list(out.prompt_token_ids) + list(out.token_ids), params)
