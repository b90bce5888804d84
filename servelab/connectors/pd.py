"""``PDConnector`` (``"pd"``): prefill on one pipeline, decode on another.

Two pipelines over the same model, each with a ``PDConnector`` on the same
channel (:mod:`servelab.connectors.channels`):

- the **producer** (``role="producer"``) runs the prompt and samples the first
  token (``max_tokens=1``). When a request ends normally, ``request_finished``
  keeps its blocks (delayed free), publishes its computed full blocks on the
  channel under a lease (in one process the consumer reads them straight from
  the producer's pool; through a directory they are written out now) and
  returns the transfer params ``{"transfer_id", "num_blocks", "token_ids"}``
  (``token_ids``: prompt + first token, the request state the decode side
  continues from). The blocks
  are freed when the consumer confirms or the lease expires
  (``finished_sending``). A producer request that is preempted or fails before
  it ends has published nothing: it recomputes (or fails) like any request, so
  freed blocks are never shipped.
- the **consumer** (``role="consumer"``) gets a request whose
  ``SamplingParams.extra_args["kv_transfer_params"]`` are the producer's params
  (and whose prompt is ``token_ids``). Its scheduler asks for an external hit:
  the blocks whose hashes match the request's own hashes (checked block by
  block: KV for other tokens is never used); they load on a thread while the
  request waits for remote KV; then it confirms. A transfer that is gone
  (lease expired, channel lost, a read error) fails the load: the consumer
  recomputes the prompt itself, never reads wrong KV.

:func:`disaggregated_generate` runs a batch this way and returns the outputs
a single pipeline would (greedy: token for token).

Single-group models only (a hybrid manager is refused with ``ValueError``).
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

__all__ = ["PDConnector", "PDMetadata", "disaggregated_generate"]

_ROLES = ("producer", "consumer")


@dataclass
class PDMetadata(KVConnectorMetadata):
    """``loads``: (request id, transfer id, [(block index, block id)]) to pull."""

    loads: list[tuple[str, str, list[tuple[int, int]]]] = field(default_factory=list)


class PDConnector(KVConnector):
    """See the module docstring.

    Args:
        role: ``"producer"`` (prefill) or ``"consumer"`` (decode).
        channel: a :class:`~servelab.connectors.channels.TransferChannel` shared by both sides.
        lease_s: how long the producer holds published blocks without a confirmation.
    """

    name = "pd"

    def __init__(self, role: str, channel: TransferChannel, *, lease_s: float = 30.0) -> None:
        super().__init__()
        if role not in _ROLES:
            raise ValueError(f"role={role!r}; valid: {_ROLES}")
        if not callable(getattr(channel, "publish", None)) or not callable(getattr(channel, "pull", None)):
            raise TypeError(f"channel must be a TransferChannel (publish, describe, pull, confirm, settle), "
                            f"got {type(channel).__name__}")
        self.role, self.channel = role, channel
        self.lease_s = check_number("lease_s", lease_s, min_value=0.0)
        self._loads: list[tuple[str, str, list[tuple[int, int]]]] = []
        self._published: set[str] = set()
        self._params: dict[str, dict[str, Any]] = {}
        self._pulled: set[str] = set()  # consumer: transfers it loaded (or tried to)
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight = 0
        self._last_meta: PDMetadata | None = None
        self.num_sent = self.num_received = self.num_failed_loads = self.num_expired = 0

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        if getattr(kv_cache_manager, "groups", None) is not None:
            raise ValueError("the pd connector serves single-group models; this pipeline has a hybrid KV cache "
                             "(several KV-cache groups)")
        super().bind_kv_cache_manager(kv_cache_manager)
        self.block_size = kv_cache_manager.block_size

    def _block_tensors(self, block_id: int) -> list[torch.Tensor]:
        return [t[block_id] for layer in self.layer_groups[0] for t in self.kv_caches[layer]]

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
            return 0, False
        params = self._request_params(request)
        if params is None or params["transfer_id"] in self._pulled:
            return 0, False
        hashes = self.channel.describe(params["transfer_id"])
        if not hashes:
            return 0, False
        mine = request.block_hashes
        n = 0
        while n < len(hashes) and n < len(mine) and hashes[n] == mine[n]:
            n += 1  # only blocks of exactly this request's tokens
        num = n * self.block_size - num_computed_tokens
        return (num, True) if num > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: Any, num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        params = self._request_params(request)
        if params is None:
            return
        tid = params["transfer_id"]
        start = request.num_computed_tokens // self.block_size
        end = (request.num_computed_tokens + num_external_tokens) // self.block_size
        self._pulled.add(tid)
        row = block_ids[0]  # one KV-cache group
        self._loads.append((request.request_id, tid, [(i, row[i]) for i in range(start, end)]))

    def build_connector_meta(self, scheduler_output: Any) -> PDMetadata:
        last = self._last_meta
        if last is not None and not last.started:  # that step was rolled back before it ran
            self._loads[:0] = last.loads  # the requests are still parked, holding their blocks
        meta = PDMetadata(step=scheduler_output.step, loads=self._loads)
        self._loads = []
        self._last_meta = meta
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        if self.role == "consumer":
            params = self._request_params(request)
            if params is not None and params["transfer_id"] not in self._pulled:
                self.channel.confirm(params["transfer_id"])  # it will not pull: release the producer early
            return False, None
        if request.status.finish_reason not in ("length", "stop"):
            return False, None  # failed or aborted: nothing to hand over
        num_blocks = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_blocks == 0:
            return False, None
        tid = request.request_id
        blocks = list(block_ids[0][:num_blocks])  # one KV-cache group
        # Published now (this step's forward wrote the KV): a pull reads the held blocks until settled.
        self.channel.publish(tid, list(request.block_hashes[:num_blocks]),
                             lambda i: self._block_tensors(blocks[i]), self.lease_s)
        self._published.add(tid)
        self.num_sent += 1
        params = {"transfer_id": tid, "num_blocks": num_blocks, "token_ids": list(request.all_token_ids)}
        self._params[tid] = params
        return True, params

    def has_pending_work(self) -> bool:
        return bool(self._published) or self._inflight > 0

    # ---- worker side --------------------------------------------------------------------------

    def wait_for_save(self) -> None:
        """Nothing: the producer publishes when a request ends (``request_finished``)."""

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._metadata
        if not isinstance(meta, PDMetadata):
            return
        for rid, tid, pairs in meta.loads:
            self._inflight += 1
            threading.Thread(target=self._pull, args=(rid, tid, pairs), daemon=True,
                             name="servelab-pd-pull").start()

    def _pull(self, rid: str, tid: str, pairs: list[tuple[int, int]]) -> None:
        dst = dict(pairs)
        try:
            ok = self.channel.pull(tid, [i for i, _ in pairs], lambda i: self._block_tensors(dst[i]))
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
        elif self._published:  # only leases pending: a short nap, then settle again
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
        if self._published:
            settled = self.channel.settle(sorted(self._published))
            self._published -= settled
            result.finished_sending |= settled
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
    prefill.step()  # the producer hears of the last confirmations and frees those blocks
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
