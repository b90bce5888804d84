"""Prefill/decode disaggregation: the option and the KV transfer it implies.

With ``PD(prefill_replicas=p, decode_replicas=d, ...)`` a cluster runs ``p``
replicas that only prefill (a request's prompt, up to its first token) and
``d`` that only decode. After its prefill (one output token), a request's decode half (its
prompt and that token) joins the least-loaded decode replica's scheduler,
which takes it through its own KV-connector path, as vLLM's P/D consumer
does (:class:`RemotePrefillConnector`, :mod:`servelab.scheduling.connector_states`):

1. admission: the local prefix-cache lookup, then the connector offers the
   rest of the prompt (partial last block included) as external tokens; the
   scheduler allocates blocks for them — waiting, in its queue order, until
   memory allows — and parks the request in ``WAITING_FOR_REMOTE_KVS``;
2. the transfer starts then: ``tokens x kv_bytes_per_token`` bytes cross the
   prefill replica's link (transfers from one prefill replica queue behind
   each other, first come, first served), taking ``kv_latency_s + bytes * 8
   / (kv_bandwidth_gbps * 1e9)`` seconds;
3. when it lands (reported with the decode replica's next step end, or at
   once if it is idle) the blocks are committed to the prefix cache and stay
   **allocated to the request** (never in the evictable pool) until it is
   admitted, computing only its first output token: no prompt token is
   recomputed unless the request is preempted later (counted in the result).

The prefill replica's blocks are released when its half ends (its KV stays
in that replica's prefix cache until evicted); a real producer holds them
until the transfer is read, which this model leaves out.

KV bytes per token come from the model's KV spec: ``num_layers x K and V x
num_kv_heads x head_size x dtype size`` (:func:`kv_bytes_per_token`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from servelab._internal.validation import check_int, check_number
from servelab.blocks.specs import AttentionSpec, FullAttentionSpec

__all__ = ["PD", "DEFAULT_KV_SPEC", "DEFAULT_NUM_LAYERS", "RemotePrefillConnector", "kv_bytes_per_token"]

DEFAULT_KV_SPEC = FullAttentionSpec(block_size=16, num_kv_heads=32, head_size=128, dtype="float16")
"""A 7B-class model with full multi-head attention (the default cost model's model)."""
DEFAULT_NUM_LAYERS = 32


def kv_bytes_per_token(spec: AttentionSpec = DEFAULT_KV_SPEC, num_layers: int = DEFAULT_NUM_LAYERS) -> int:
    """Bytes of KV one token occupies across ``num_layers`` layers of ``spec``
    (its page size per block, per layer, divided by the block size)."""
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an attention KVCacheSpec, got {type(spec).__name__}")
    check_int("num_layers", num_layers, min_value=1)
    return spec.page_size_bytes * num_layers // spec.block_size


@dataclass(frozen=True)
class PD:
    """A disaggregated cluster: ``prefill_replicas`` + ``decode_replicas`` replicas.

    Attributes:
        prefill_replicas, decode_replicas: how many of each (>= 1).
        kv_bandwidth_gbps: each prefill replica's link, in Gb/s (> 0).
        kv_latency_s: fixed cost of one transfer, in seconds (>= 0).
        kv_bytes_per_token: bytes of KV per token; None: from the cluster's
            ``kv_spec`` and ``num_layers`` (:func:`kv_bytes_per_token`).
    """

    prefill_replicas: int = 1
    decode_replicas: int = 1
    kv_bandwidth_gbps: float = 100.0
    kv_latency_s: float = 1e-3
    kv_bytes_per_token: int | None = None

    def __post_init__(self) -> None:
        check_int("prefill_replicas", self.prefill_replicas, min_value=1)
        check_int("decode_replicas", self.decode_replicas, min_value=1)
        check_number("kv_bandwidth_gbps", self.kv_bandwidth_gbps, min_value=0.0)
        if not self.kv_bandwidth_gbps > 0:
            raise ValueError(f"kv_bandwidth_gbps={self.kv_bandwidth_gbps!r} must be > 0")
        check_number("kv_latency_s", self.kv_latency_s, min_value=0.0)
        if self.kv_bytes_per_token is not None:
            check_int("kv_bytes_per_token", self.kv_bytes_per_token, min_value=1)

    @property
    def num_replicas(self) -> int:
        return self.prefill_replicas + self.decode_replicas

    def transfer_s(self, num_tokens: int, bytes_per_token: int) -> float:
        """Seconds one transfer of ``num_tokens`` tokens' KV takes on an idle link."""
        return self.kv_latency_s + num_tokens * bytes_per_token * 8 / (self.kv_bandwidth_gbps * 1e9)


class RemotePrefillConnector:
    """The scheduler side of a KV connector for a decode replica whose prompts were prefilled
    elsewhere (the simulator's stand-in for vLLM's P/D consumer; no worker side: the simulator
    moves no bytes, it times them).

    ``expect(request_id, num_tokens)`` before the request is added: its first ``num_tokens``
    tokens' KV is remote. At admission the connector offers what the local prefix hit lacks
    (asynchronous: the request waits in ``WAITING_FOR_REMOTE_KVS``); once the scheduler holds
    blocks for it, ``start_transfer(request_id, num_tokens)`` is called, and the simulator reports
    the load landed with a step's ``KVTransferResult``. ``holds_loaded_blocks``: the scheduler
    keeps the landed blocks allocated to the request until it runs, and takes a partial last block
    too (vLLM's semantics; see :mod:`servelab.scheduling.connector_states`).
    """

    holds_loaded_blocks = True

    def __init__(self, start_transfer: Callable[[str, int], None]) -> None:
        if not callable(start_transfer):
            raise TypeError(f"start_transfer must be callable, got {type(start_transfer).__name__}")
        self._start_transfer = start_transfer
        self._expected: dict[str, int] = {}

    def expect(self, request_id: str, num_tokens: int) -> None:
        self._expected[request_id] = num_tokens

    def forget(self, request_id: str) -> None:
        self._expected.pop(request_id, None)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        remote = self._expected.get(request.request_id, 0)
        if remote <= num_computed_tokens:
            return 0, False
        return remote - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, block_ids: Any, num_external_tokens: int) -> None:
        self._expected.pop(request.request_id, None)
        if num_external_tokens:
            self._start_transfer(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> None:
        return None

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        self._expected.pop(request.request_id, None)
        return False, None

    def has_pending_work(self) -> bool:
        return False
