"""The model's per-step view of its attention ops: plans once per sliding window, checks once per
step, and takes the direct calls a decode step's later layers can take.

A model's forward makes one :class:`StepAttention` per KV-cache group (:func:`layer_attentions`)
and every layer calls its ``reshape_and_cache`` / ``paged_attention`` (the public ops' signatures,
``k_scale`` / ``v_scale`` for quantized pages) or, on a decode step, one of the two direct paths:

- :meth:`StepAttention.carried_attend`: float32 pages whose K/V the default backend carries across
  steps (:mod:`servelab.attention.decode_kv`);
- :meth:`StepAttention.quantized_attend`: int8 / float8 pages read by the C kernel
  (:class:`servelab.attention.cpu_decode_quant.DecodeStep`).

Each reaches exactly what the two public calls would reach on that step, or returns ``None`` before
writing anything (the caller then makes the public calls). They are taken only when nothing that
could change the answer was swapped: the default backend's own write and ``sdpa`` attention, these
two methods not overridden (a subclass such as Gemma 2's softcap view keeps the public calls), no
token tree, no padding rows.
"""

from __future__ import annotations

from typing import Any

import torch

from servelab.attention import cpu_decode_quant
from servelab.attention import ops as attention_ops
from servelab.attention.backends import AttentionBackend, SdpaAttentionBackend
from servelab.models.metadata import AttentionMetadata, GroupedAttentionMetadata

_UNKNOWN = object()  # StepAttention._carried: not yet decided for this window


class StepAttention:
    """Per-forward view of the attention ops: plans once per sliding window and
    validates once per step, not once per layer.

    For an :class:`~servelab.attention.backends.AttentionBackend` the first
    layer goes through the public ops (capability gate, argument and value
    checks); every later layer has the same shapes, dtypes and metadata, so it
    calls the backend's implementation directly with ``check_inputs=False``
    and the step's ``plan``. ``check_values=False`` (the model's
    ``check_inputs=False``, as the pipeline sets it: its runner builds the
    metadata) passes ``check_inputs=False`` to the first layer too, keeping
    only the capability gate: the argument checks were ~20% of a small
    model's decode step. Any other ops object (the reference module, a
    researcher's object) is called with the reference signature every layer.
    """

    def __init__(self, ops: Any, metadata: AttentionMetadata, block_size: int, *, check_values: bool = True,
                 chain: bool = False, previous_plans: dict[int | None, Any] | None = None) -> None:
        self.ops, self.metadata, self.block_size = ops, metadata, block_size
        self.check_values = check_values
        self.is_backend = isinstance(ops, AttentionBackend)
        self.chain, self.previous_plans = chain, previous_plans or {}
        self.plans: dict[int | None, Any] = {}
        self.checked_write = False
        self.prepared_slots: tuple | None = None  # (int64 slots, kept rows) for the default writer
        self.checked_read: set[int | None] = set()  # sliding windows whose first call was checked
        self._rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._carried: dict[int | None, Any] = {}  # sliding window -> DecodeKV or None (carried_attend)
        self._quantized: dict[int | None, Any] = {}  # sliding window -> DecodeStep or None (quantized_attend)

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and the signed ``sin`` as ``[T, 1, D]`` for :func:`rotate`, built once per step
        (every layer passes the same ``cos``/``sin`` ``[T, D]``) and reused by the later layers."""
        cached = self._rope
        if cached is None or cached[0] is not cos or cached[1] is not sin:
            half = cos.shape[-1] // 2
            signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            cached = self._rope = (cos, sin, cos[:, None, :], signed[:, None, :])
        return cached[2], cached[3]

    def reshape_and_cache(self, key, value, key_cache, value_cache, k_scale=None, v_scale=None) -> None:
        slots = self.metadata.slot_mapping
        # A quantized cache's scales (servelab.blocks.kv_quant), passed only when there are some.
        scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        if not self.is_backend:
            return self.ops.reshape_and_cache(key, value, key_cache, value_cache, slots, **scales)
        if self.checked_write:
            if self.prepared_slots is not None:  # the default writer: slots prepared once per step
                return attention_ops.write_prepared(key, value, key_cache, value_cache, *self.prepared_slots,
                                                    **scales)
            return self.ops._reshape_and_cache(key, value, key_cache, value_cache, slots, check_inputs=False,
                                               **scales)
        self.ops.reshape_and_cache(key, value, key_cache, value_cache, slots, check_inputs=self.check_values,
                                   **scales)
        self.checked_write = True
        if type(self.ops)._reshape_and_cache is AttentionBackend._reshape_and_cache and slots.shape[0]:
            self.prepared_slots = attention_ops.prepare_slots(slots)

    def carried_attend(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, *, scale: float, sliding_window: int | None) -> torch.Tensor | None:
        """:meth:`reshape_and_cache` then :meth:`paged_attention` in two direct calls, for the layers
        after the first of a pure decode step whose K/V the default backend carries: the write of
        ``write_prepared`` and the kernel call of ``DecodeKV.attend_extending``, which is what the
        two public calls reach on that step, without the backend's dispatch between them (~20 us
        of a layer). Returns ``[T, Hq, D]``, or ``None`` (nothing written): take the public calls."""
        decode_kv = self._carried.get(sliding_window, _UNKNOWN)
        if decode_kv is _UNKNOWN:
            if not (self.checked_write and sliding_window in self.checked_read):
                return None  # the step's first layer: the public, checked calls
            decode_kv = self._carried[sliding_window] = self._carried_plan(sliding_window)
        slots = self.prepared_slots
        if decode_kv is None or slots is None:
            return None
        attention_ops.write_prepared(key, value, key_cache, value_cache, *slots)
        out = decode_kv.attend_extending(query, key_cache, value_cache, scale)
        if out is None:  # written: attend the public way
            return self.paged_attention(query, key_cache, value_cache, scale=scale, sliding_window=sliding_window)
        return out

    def _carried_plan(self, sliding_window: int | None) -> Any:
        """The step's ``DecodeKV`` when :meth:`carried_attend` reaches exactly what the public calls
        would (:meth:`_direct_calls_reach_the_defaults`, a plan whose every token is a carried decode
        row); else ``None``."""
        plan = self.plans.get(sliding_window)
        if not self._direct_calls_reach_the_defaults() or plan is None or plan.tree:
            return None
        decode_kv = getattr(plan, "decode_kv", None)
        return decode_kv if decode_kv is not None and plan.decode_tokens is None else None

    def quantized_attend(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, *, scale: float,
                         sliding_window: int | None) -> torch.Tensor | None:
        """:meth:`reshape_and_cache` then :meth:`paged_attention` over quantized pages in two C calls
        (:meth:`~servelab.attention.cpu_decode_quant.DecodeStep.write_and_attend`), for the layers
        after the first of a pure decode step on the default backend: exactly what the public calls
        reach on that step (the C int8 write, or the torch write for float8, then the C kernel),
        without the per-layer dispatch, plan checks and argument rebuilding between them. Returns
        ``[T, Hq, D]``, or ``None`` (nothing written): take the public calls."""
        step = self.quantized_decode_step(sliding_window)
        slots = self.prepared_slots
        if step is None or slots is None:
            return None
        return step.write_and_attend(key, value, query, key_cache, value_cache, k_scale, v_scale, slots[0], scale)

    def quantized_decode_step(self, sliding_window: int | None) -> Any:
        """The :class:`~servelab.attention.cpu_decode_quant.DecodeStep` the later layers' direct calls
        use for this window (:meth:`quantized_attend`; also
        :mod:`servelab.models.quantized_decode_layers`), once the step's first layer took the public,
        checked calls; else ``None``. Its rows' slots: ``prepared_slots[0]``."""
        step = self._quantized.get(sliding_window, _UNKNOWN)
        if step is _UNKNOWN:
            if not (self.checked_write and sliding_window in self.checked_read):
                return None  # the step's first layer: the public, checked calls
            step = self._quantized[sliding_window] = self._quantized_step(sliding_window)
        return step

    def _quantized_step(self, sliding_window: int | None) -> Any:
        """The step's :class:`~servelab.attention.cpu_decode_quant.DecodeStep` when
        :meth:`quantized_attend` reaches exactly what the public calls would
        (:meth:`_direct_calls_reach_the_defaults`, a pure decode step: one query row per sequence);
        else ``None``."""
        m = self.metadata
        plan = self.plans.get(sliding_window)
        if (not self._direct_calls_reach_the_defaults() or plan is None or plan.tree
                or not getattr(plan, "pure_decode", False) or m.seq_lens.device.type != "cpu"):
            return None
        return cpu_decode_quant.DecodeStep(m.block_table, m.seq_lens, sliding_window)

    def _direct_calls_reach_the_defaults(self) -> bool:
        """Whether this step's public calls reach the default backend's own write and ``sdpa``
        attention through this class's two methods (not overridden), with the default writer's
        slots, no padding rows and no token tree: the condition for either direct path."""
        ops = type(self.ops)
        return (type(self).reshape_and_cache is StepAttention.reshape_and_cache
                and type(self).paged_attention is StepAttention.paged_attention
                and self.is_backend and ops._paged_attention is SdpaAttentionBackend._paged_attention
                and ops._reshape_and_cache is AttentionBackend._reshape_and_cache
                and self.prepared_slots is not None and self.prepared_slots[1] is None
                and getattr(self.metadata, "tree_mask", None) is None)

    def paged_attention(self, query, key_cache, value_cache, k_scale=None, v_scale=None, *, scale: float,
                        sliding_window: int | None):
        m = self.metadata
        args = (query, key_cache, value_cache, m.block_table, m.seq_lens, m.query_start_loc)
        tree = {} if getattr(m, "tree_mask", None) is None else {"tree_mask": m.tree_mask}  # token trees
        # A quantized cache's scales go with it (never to plan()).
        scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        if not self.is_backend:
            extra = {} if sliding_window is None else {"sliding_window": sliding_window}
            return self.ops.paged_attention(*args, scale=scale, causal=True, **extra, **tree, **scales)
        if sliding_window not in self.plans:
            chaining = {"chain": True, "previous": self.previous_plans.get(sliding_window)} if self.chain else {}
            self.plans[sliding_window] = self.ops.plan(m.block_table, m.seq_lens, m.query_start_loc,
                                                       block_size=self.block_size, causal=True,
                                                       sliding_window=sliding_window, **chaining, **tree)
        plan = self.plans[sliding_window]
        extra = {**tree, **scales} if plan is None else {"plan": plan, **tree, **scales}
        if sliding_window not in self.checked_read:
            self.checked_read.add(sliding_window)
            return self.ops.paged_attention(*args, scale=scale, causal=True, sliding_window=sliding_window,
                                            check_inputs=self.check_values, **extra)
        return self.ops._paged_attention(*args, scale=scale, causal=True, sliding_window=sliding_window,
                                         softcap=None, out=None, num_splits=None, return_lse=False,
                                         check_inputs=False, **extra)



def layer_attentions(make: Any, ops: Any, metadata: GroupedAttentionMetadata, *args: Any) -> list[Any]:
    """Per model layer, the step attention of its KV-cache group: ``make(ops,
    group_metadata, group_block_size, *args)`` once per group (so plans and
    checks are still once per group and window), shared by the group's layers."""
    steps = [make(ops, m, bs, *args) for m, bs in zip(metadata.groups, metadata.block_sizes)]
    return [steps[g] for g in metadata.layer_groups]
