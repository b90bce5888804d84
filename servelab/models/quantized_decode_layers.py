"""A pure decode step's layers after the first, over int8 pages, as prebuilt C calls.

Why: on SmolLM2's batch-16 decode step over int8 pages each glued layer
(:func:`servelab.models.decode_glue.forward`) is four C calls and a SiLU, and the Python
between them (fresh q/k/v and output tensors, views, the attention's dispatch down to the kernel,
the arguments of every call) cost ~100 us a layer: that Python runs right after the layer's weights
streamed through the caches, so nearly every object it touches is a cache miss (asked back to
back, the same work took a fifth of that). Over 30 layers that was ~3 ms of a ~52 ms step at two
threads, most of what stood between the step and its GEMMs.

What runs is exactly what :func:`~servelab.models.decode_glue.forward` runs for each layer when the
step's attention takes its direct quantized path (``StepAttention.quantized_attend`` ->
``DecodeStep.write_and_attend``, one C call for the int8 write and the kernel): the same C calls and
SiLU (C's or torch's, as ``cpu_silu.usable`` answers), in the same order, on the same values, so the same bits
(``tests/kv_quant/test_kv_quant_direct_path.py``). What differs is when the Python runs: every
layer's call arguments (addresses and sizes) are gathered in one pass after the first layer, and the
layers' temporaries (q/k/v, the attention output, the rows between layers) are buffers of this step.
They never reach user code: between the calls only C kernels run, and the model's final norm makes
a new tensor of the last layer's rows.

When (:func:`prepare`): every layer glues (``decode_glue.step_parts``) with the same shapes and
the first layer's sliding window; the step's attention offers its
:class:`~servelab.attention.cpu_decode_quant.DecodeStep` for that window
(``StepAttention.quantized_decode_step``: the first layer took the public, checked calls, the default
``sdpa`` backend, a pure decode step, no padding rows); and every layer's pages are int8 pages the
one-call path takes. Anything else: each layer's own :func:`~servelab.models.decode_glue.forward`.
"""

from __future__ import annotations

from typing import Any

import torch

from servelab.models import cpu_silu, decode_glue

__all__ = ["DirectLayers", "prepare"]


class DirectLayers:
    """The prepared layers: :meth:`run` makes their calls and returns the last layer's rows
    float32 ``[rows, hidden]`` (a buffer of this step)."""

    __slots__ = ("calls", "gate", "silu_in_c", "output", "held")

    def __init__(self, calls: list[tuple[tuple, ...]], gate: torch.Tensor, silu_in_c: bool, output: torch.Tensor,
                 held: tuple) -> None:
        self.calls, self.gate, self.silu_in_c, self.output = calls, gate, silu_in_c, output
        self.held = held  # every tensor (and the DecodeStep) whose address the calls hold

    def run(self) -> torch.Tensor:
        lib = decode_glue._library.lib
        qkv, attend, out, down = (lib.servelab_glue_qkv, lib.servelab_write_decode_int8, lib.servelab_glue_out,
                                  lib.servelab_glue_down)
        # torch's SiLU in place, as decode_glue.forward, where the C SiLU is not used (the down
        # call's silu_in_c argument says which)
        silu = None if self.silu_in_c else torch._C._nn.silu_
        gate = self.gate
        for qkv_args, attend_args, out_args, down_args in self.calls:
            qkv(*qkv_args)
            if attend(*attend_args) != 0:
                raise ValueError("servelab_write_decode_int8 refused a layer that prepare() accepted")
            out(*out_args)
            if silu is not None:
                silu(gate)
            down(*down_args)
        return self.output


def prepare(glued: list[Any], x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], caches: list[Any],
            step_attention: Any) -> DirectLayers | None:
    """The layers of ``glued`` (their ``GlueParts``, the second layer's first) with their
    ``caches`` as :class:`DirectLayers` taking ``x`` float32 ``[rows, hidden]`` (the first layer's
    output), or ``None`` when any condition of the module docstring fails."""
    if (not glued or len(glued) != len(caches) or any(len(kv_cache) != 4 for kv_cache in caches)
            or not hasattr(step_attention, "quantized_decode_step")):
        return None  # float32 pages (no scales), or a step attention without the direct path
    first = glued[0].attention
    window = first.sliding_window
    step = step_attention.quantized_decode_step(window)
    slots = step_attention.prepared_slots
    if step is None or slots is None:
        return None
    rows, hidden = x.shape
    heads, kv_heads, head_dim, intermediate = first.num_heads, first.num_kv_heads, first.head_dim, glued[0].intermediate
    shape = (heads, kv_heads, head_dim, intermediate, glued[0].hidden, window, first.scale)
    if hidden != glued[0].hidden:
        return None
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv_size = q_size + 2 * kv_size
    normed, h, gate_up = decode_glue._scratch(rows, hidden, 2 * intermediate)
    new = decode_glue._new
    qkv, qk, attn = new(rows, qkv_size), new(rows, heads + kv_heads, head_dim), new(rows, heads, head_dim)
    q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, q_size + kv_size:].view(rows, kv_heads, head_dim)
    # The rows between layers: one buffer, each layer's output written over its input. Safe: a layer
    # reads its input rows only in its first two calls (the input norm, then the residual into h) and
    # writes its output in the last, from h.
    between = new(rows, hidden)
    normed_at, qkv_at, qk_at, attn_at, h_at, gate_up_at = (t.data_ptr() for t in (normed, qkv, qk, attn, h, gate_up))
    cos, signed_sin = (t.data_ptr() for t in tables)
    threads = torch.get_num_threads()
    silu_in_c = cpu_silu.usable(rows, intermediate)
    calls: list[tuple[tuple, ...]] = []
    x_in = x
    for i, (glue, kv_cache) in enumerate(zip(glued, caches)):
        a = glue.attention
        if (a.num_heads, a.num_kv_heads, a.head_dim, glue.intermediate, glue.hidden, a.sliding_window,
                a.scale) != shape:
            return None
        attend = step.int8_call(k, v, q, *kv_cache, slots[0], a.scale, attn)
        if attend is None:
            return None
        (panels, bias), (o_panels, o_bias), (gu_panels, gu_bias), (down_panels, down_bias) = map(
            decode_glue._pointers, glue.gemms)
        calls.append((
            (x_in.data_ptr(), decode_glue._weight(glue.input_norm).data_ptr(), glue.input_norm.eps, normed_at,
             panels, bias, qkv_at, qk_at, cos, signed_sin, rows, hidden, qkv_size, heads + kv_heads, head_dim,
             threads),
            attend,
            (attn_at, q_size, o_panels, o_bias, x_in.data_ptr(), h_at, decode_glue._weight(glue.post_norm).data_ptr(),
             glue.post_norm.eps, normed_at, gu_panels, gu_bias, gate_up_at, rows, q_size, hidden, 2 * intermediate,
             threads),
            (gate_up_at, intermediate, silu_in_c, down_panels, down_bias, h_at, between.data_ptr(), rows, hidden,
             threads),
        ))
        x_in = between
    held = (step, glued, caches, tables, x, normed, h, gate_up, qkv, qk, attn, between)
    return DirectLayers(calls, gate_up[:, :intermediate], silu_in_c, x_in, held)
