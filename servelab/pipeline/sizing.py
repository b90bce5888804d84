"""How big the default KV pool is, and how much memory a run used.

The rule (used when ``num_blocks`` is None):

1. **What the run can use**: ``max_num_seqs`` requests of ``max_model_len``
   tokens (plus each one's draft lookahead) — more blocks could never be held
   at once.
2. **A memory budget**: ``kv_cache_memory_bytes`` when given; otherwise
   half the model's weight bytes, raised to at least one full
   ``max_model_len`` sequence (so any request that fits the model fits the
   pool) and at least 64 MiB, and capped at a quarter of the memory free
   right now (``MemAvailable`` of ``/proc/meminfo`` on the CPU,
   ``torch.cuda.mem_get_info`` on a GPU) — but never below the one-sequence
   floor.

The pool is the smaller of the two. A budget too small for 2 blocks (the
null block and one usable block) is refused, not rounded up.

**Bounds before allocation** (:func:`check_pool_fits`): whatever sized the pool
(``num_blocks``, ``kv_cache_memory_bytes`` or the default), its pages and the
block pool's own host bookkeeping (:data:`HOST_BYTES_PER_BLOCK` a block) must
fit in the memory free on the device now; otherwise a ``ValueError`` names the
setting, its value, the limit and what to do — before a byte is allocated (a
billion blocks used to grow the process for minutes). Why half the weights: on a CPU the KV cache competes with the
weights for the same RAM, and a serving run of a small model rarely holds
more context than its weights are large (SmolLM2-135M in float32: 540 MB of
weights, a 270 MB budget = 5,800 tokens = sixteen 360-token requests); vLLM's
"fraction of device memory" would, on a shared CPU machine, take gigabytes
for a 135M model. Pass ``num_blocks`` or ``kv_cache_memory_bytes`` to choose.

:func:`peak_rss_bytes` is the process's peak resident memory, which
:class:`~servelab.pipeline.RunMetrics` reports beside throughput.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

MIN_KV_CACHE_BYTES = 64 << 20
"""Smallest default budget (64 MiB)."""

HOST_BYTES_PER_BLOCK = 512
"""Host memory the block layer spends per pool block (its ``KVCacheBlock`` object, free-list links and
hash-map entries: ~300-500 bytes measured on CPython 3.11), counted by :func:`check_pool_fits`."""


def check_pool_fits(num_blocks: int, block_bytes: int, *, setting: str, value: object,
                    device: torch.device | str = "cpu") -> None:
    """``ValueError`` unless ``num_blocks`` blocks of ``block_bytes`` (all layers' pages of one block)
    plus their host bookkeeping fit in the memory free now. ``setting=value`` is what sized the pool."""
    device = torch.device(device)
    free = available_memory_bytes(device)
    need = num_blocks * block_bytes
    host = num_blocks * HOST_BYTES_PER_BLOCK
    if device.type == "cpu":
        need += host
    else:
        host_free = available_memory_bytes("cpu")
        if host_free is not None and host > host_free:
            raise ValueError(f"{setting}={value!r} asks for {num_blocks:,} KV blocks, whose bookkeeping alone "
                             f"needs {host / 2**30:.1f} GiB of host memory; {host_free / 2**30:.1f} GiB is free")
    if free is not None and need > free:
        fit = max(free // (block_bytes + (HOST_BYTES_PER_BLOCK if device.type == "cpu" else 0)), 0)
        raise ValueError(f"{setting}={value!r} asks for {num_blocks:,} KV blocks ({need / 2**30:.1f} GiB with "
                         f"the pool's bookkeeping); {free / 2**30:.1f} GiB is free on {device}, enough for about "
                         f"{fit:,} blocks: lower {setting} (or leave it unset for the default pool)")


def blocks_for_budget(kv_cache_memory_bytes: int, block_bytes: int, *, given: bool) -> int:
    """How many blocks ``kv_cache_memory_bytes`` holds; a user's budget (``given``) below 2 blocks
    is refused, the default one is raised to 2."""
    blocks = int(kv_cache_memory_bytes) // block_bytes
    if blocks < 2 and given:
        raise ValueError(f"kv_cache_memory_bytes={kv_cache_memory_bytes} holds {blocks} KV block(s) of "
                         f"{block_bytes:,} bytes; valid: at least {2 * block_bytes:,} (the null block and one "
                         "usable block), or leave it unset for the default budget")
    return max(blocks, 2)


def available_memory_bytes(device: torch.device | str = "cpu") -> int | None:
    """Memory free for a new allocation on ``device`` now, or None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # no driver, or a device index that does not exist
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def model_weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers (0 if it has none)."""
    total = 0
    for getter in ("parameters", "buffers"):
        tensors = getattr(model, getter, None)
        if callable(tensors):
            total += sum(t.numel() * t.element_size() for t in tensors())
    return total


def default_kv_cache_budget(model: Any, *, bytes_per_token: int, max_model_len: int,
                            device: torch.device | str = "cpu") -> int:
    """The default KV memory budget in bytes (rule 2 of the module docstring)."""
    one_sequence = bytes_per_token * max_model_len
    budget = max(model_weight_bytes(model) // 2, MIN_KV_CACHE_BYTES, one_sequence)
    free = available_memory_bytes(device)
    if free is not None:
        budget = min(budget, max(free // 4, one_sequence))
    return budget


def default_num_blocks(spec: Any, num_layers: int, *, max_model_len: int, max_num_seqs: int,
                       num_speculative_tokens: int = 0, kv_cache_memory_bytes: int | None = None,
                       model: Any = None, device: torch.device | str = "cpu") -> int:
    """Blocks (null block included) for the default pool; see the module docstring.

    ``spec`` is the KV cache spec (``block_size``, ``page_size_bytes`` per layer
    and block); ``model`` sizes the default budget when no
    ``kv_cache_memory_bytes`` is given.
    """
    per_seq = -(-(max_model_len + num_speculative_tokens) // spec.block_size)
    wanted = max_num_seqs * per_seq + 1
    block_bytes = spec.page_size_bytes * num_layers
    given = kv_cache_memory_bytes is not None
    if kv_cache_memory_bytes is None:
        kv_cache_memory_bytes = default_kv_cache_budget(
            model, bytes_per_token=-(-block_bytes // spec.block_size),
            max_model_len=max_model_len + num_speculative_tokens, device=device)
    affordable = blocks_for_budget(kv_cache_memory_bytes, block_bytes, given=given)
    return max(min(wanted, affordable), 2)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (0 where unknown)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes; Linux: KiB
