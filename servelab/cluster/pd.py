"""Prefill/decode disaggregation: the option and the KV transfer it implies.

With ``PD(prefill_replicas=p, decode_replicas=d, ...)`` a cluster runs ``p``
replicas that only prefill (a request's prompt, up to its first token) and
``d`` that only decode. After its prefill, a request's KV (``num_prompt_tokens
x kv_bytes_per_token`` bytes) crosses the prefill replica's link: transfers
from one prefill replica queue behind each other (first come, first served),
each taking ``kv_latency_s + bytes * 8 / (kv_bandwidth_gbps * 1e9)`` seconds.
When it arrives, the decode replica must find memory for it: until
``allocate_slots`` succeeds the request waits (vLLM's
``WAITING_FOR_REMOTE_KVS``), retried after each of that replica's steps, in
arrival order. The received blocks are written into the decode replica's
prefix cache (most recently used, so evicted last) and the request joins its
scheduler, which admits it with the prompt cached (the tokens of a last
partial block, and the first output token, are computed there). Under memory
pressure the scheduler may evict them before admission, and the decode
replica then recomputes the prompt, as a real one would have to.

KV bytes per token come from the model's KV spec: ``num_layers x K and V x
num_kv_heads x head_size x dtype size`` (:func:`kv_bytes_per_token`).
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab._internal.validation import check_int, check_number
from servelab.blocks.specs import AttentionSpec, FullAttentionSpec

__all__ = ["PD", "DEFAULT_KV_SPEC", "DEFAULT_NUM_LAYERS", "kv_bytes_per_token"]

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
