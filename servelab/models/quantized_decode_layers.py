"""A pure decode step's layers after the first, over int8 pages, as C calls prepared once.

Why: on SmolLM2's batch-16 decode step over int8 pages each glued layer
(:func:`servelab.models.decode_glue.forward`) is four C calls and a SiLU, and the Python
between them (fresh q/k/v and output tensors, views, the attention's dispatch down to the kernel,
the arguments of every call) cost ~100 us a layer: that Python runs right after the layer's weights
streamed through the caches, so nearly every object it touches is a cache miss. Gathering every
layer's arguments in one pass after the first layer took that to ~20 us a layer (~0.6 ms of the
step), and making the ~120 calls from Python cost ~0.3 ms more. Now the arguments are C structs
(``csrc/decode_layers.c``): one per layer, made once and kept while nothing they were made from
changes, and one for the step, refreshed each step (its rows, slots, block table, lengths and
RoPE tables); with C's SiLU every layer runs in one C call.

What runs is exactly what :func:`~servelab.models.decode_glue.forward` runs for each layer when the
step's attention takes its direct quantized path (``StepAttention.quantized_attend`` ->
``DecodeStep.write_and_attend``, one C call for the int8 write and the kernel): the same C calls and
SiLU (C's or torch's, as ``cpu_silu.usable`` answers), in the same order, on the same values, so the same bits
(``tests/kv_quant/test_kv_quant_direct_path.py``). The layers' temporaries (q/k/v, the attention
output, the rows between layers) are buffers kept with the structs; they never reach user code:
between the calls only C kernels run, and the last layer writes a new tensor each step.

When (:func:`prepare`): every layer glues (``decode_glue.step_parts``) with the same sizes and the
first layer's sliding window; the step's attention offers its
:class:`~servelab.attention.cpu_decode_quant.DecodeStep` for that window
(``StepAttention.quantized_decode_step``: the first layer took the public, checked calls, the default
``sdpa`` backend, a pure decode step, no padding rows); and every layer's pages are int8 pages, laid
out alike, that the one-call path takes. Anything else: each layer's own
:func:`~servelab.models.decode_glue.forward`.

Kept structs are reused when, asked again each step: the glued parts are the same objects
(``step_parts`` gives its last answer while the layers' modules, classes, weights and hooks are
unchanged), every layer's sizes, window, softmax scale and norms' eps read the same, its cache
tensors are the same objects at the same addresses, and the rows' count and width, the SiLU choice
and inference mode are the same. Not seen: a cache tensor whose strides are changed in place
(``as_strided_``) at the same address. They are kept per thread (each thread its own buffers) and
per owner (the model's layer list), and dropped with it; they hold the cache tensors weakly, so a
pool whose pipeline is gone is freed at once, not at the model's next step.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from typing import Any, Iterator

import torch

from servelab.models import cpu_silu, decode_glue

__all__ = ["DirectLayers", "prepare", "timed_attention"]

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class LayerArgs(ctypes.Structure):
    """``servelab_layer_args`` (``csrc/decode_layers.c``): one layer's weights, norms and pages."""

    _fields_ = [*((name, _P) for name in ("input_norm", "post_norm", "qkv_panels", "qkv_bias", "o_panels", "o_bias",
                                          "gate_up_panels", "gate_up_bias", "down_panels", "down_bias", "k_cache",
                                          "v_cache", "k_scale", "v_scale")),
                *((name, _F) for name in ("input_eps", "post_eps", "scale"))]


class StepArgs(ctypes.Structure):
    """``servelab_step_args``: the step's inputs, the layers' buffers and sizes."""

    _fields_ = [*((name, _P) for name in ("x", "cos", "signed_sin", "slots", "block_table", "seq_lens", "scores",
                                          "cache_strides", "scale_strides")),
                *((name, _I) for name in ("table_stride", "width", "static_scales", "num_threads")),
                *((name, _P) for name in ("normed", "qkv", "qk", "attn", "h", "gate_up", "between", "out")),
                *((name, _I) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                          "block_size", "window", "silu_in_c", "time_attention")),
                ("attention_seconds", ctypes.c_double)]


_sizes_checked: list = []  # the library whose struct sizes matched this module's mirror


def _checked(lib: Any) -> Any:
    """``lib``, once its structs' sizes (``servelab_decode_layers_sizes``) are found equal to the
    mirror's: a drift between the two is a bug, refused before any call."""
    if not (_sizes_checked and _sizes_checked[0] is lib):
        sizes = (lib.servelab_decode_layers_sizes(0), lib.servelab_decode_layers_sizes(1))
        if sizes != (ctypes.sizeof(LayerArgs), ctypes.sizeof(StepArgs)):
            raise RuntimeError(f"csrc/decode_layers.c's struct sizes {sizes} differ from quantized_decode_layers' "
                               f"mirror {(ctypes.sizeof(LayerArgs), ctypes.sizeof(StepArgs))}")
        _sizes_checked[:] = [lib]
    return lib


class DirectLayers:
    """Prepared layers: :meth:`run` makes their calls and returns the last layer's rows float32
    ``[rows, hidden]`` (a new tensor each step). Made by :func:`prepare`."""

    def __init__(self, glued: list[Any], caches: list[Any], fixed: tuple, key: tuple, rows: int) -> None:
        first = glued[0].attention
        heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        intermediate, hidden = glued[0].intermediate, glued[0].hidden
        self.glued, self.fixed, self.key = glued, fixed, key
        # the cache tensors, weakly: a dropped pool (the pipeline gone, the model kept) is freed, and
        # these structs are then not reused (prepare compares the step's own tensors with these)
        self.cache_refs = tuple(tuple(map(weakref.ref, kv_cache)) for kv_cache in caches)
        self.silu_in_c = key[2]
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        normed, h, gate_up = decode_glue._scratch(rows, hidden, 2 * intermediate)
        new = decode_glue._new
        qkv, qk, attn, between = (new(rows, q_size + 2 * kv_size), new(rows, heads + kv_heads, head_dim),
                                  new(rows, heads, head_dim), new(rows, hidden))
        # the views the step's layout is asked with (DecodeStep.int8_step), as forward passes them
        self.q, self.k, self.v = qk[:, :heads], qk[:, heads:], qkv[:, q_size + kv_size:].view(rows, kv_heads, head_dim)
        self.attn, self.gate, self.rows, self.hidden = attn, gate_up[:, :intermediate], rows, hidden
        self.buffers = (normed, h, gate_up, qkv, qk, attn, between)  # the structs hold their addresses
        self.step = StepArgs(normed=normed.data_ptr(), qkv=qkv.data_ptr(), qk=qk.data_ptr(), attn=attn.data_ptr(),
                             h=h.data_ptr(), gate_up=gate_up.data_ptr(), between=between.data_ptr(), rows=rows,
                             hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                             intermediate=intermediate, block_size=caches[0][0].shape[1],
                             window=int(first.sliding_window or 0), silu_in_c=int(self.silu_in_c))
        self.layers = (LayerArgs * len(glued))(*map(_layer_args, glued, caches))
        self.step_at, self.layers_at = ctypes.addressof(self.step), ctypes.addressof(self.layers)
        self.count = len(glued)
        self.layer_at = [self.layers_at + i * ctypes.sizeof(LayerArgs) for i in range(len(glued))]
        self.step_held: tuple | None = None  # the step's tensors whose addresses the step struct holds

    def refresh(self, step: Any, slots: torch.Tensor, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor],
                first_cache: Any) -> bool:
        """Point the step struct at this step's inputs: ``x`` float32 ``[rows, hidden]`` (the first
        layer's output), ``slots`` int64 ``[rows]``, the RoPE ``tables``, ``step`` (the
        ``DecodeStep``); ``False`` when the step's int8 call would not take these layers' tensors
        (asked of ``first_cache``, the first layer's cache tensors: every layer's are laid out alike)."""
        threads = torch.get_num_threads()
        info = step.int8_step(self.k, self.v, self.q, *first_cache, slots, threads)
        if info is None or not (x.dtype is torch.float32 and x.is_contiguous()
                                and x.shape == (self.rows, self.hidden)):
            return False
        out = decode_glue._new(self.rows, self.hidden)
        s = self.step
        s.x, s.cos, s.signed_sin, s.slots, s.out = x.data_ptr(), tables[0].data_ptr(), tables[1].data_ptr(), \
            slots.data_ptr(), out.data_ptr()
        s.block_table, s.table_stride, s.seq_lens, s.width, s.scores = (info.block_table, info.table_stride,
                                                                        info.seq_lens, info.width, info.scores)
        s.cache_strides, s.scale_strides, s.static_scales, s.num_threads = (info.cache_strides, info.scale_strides,
                                                                            info.static_scales, threads)
        s.time_attention, s.attention_seconds = _timer is not None, 0.0
        self.step_held = (step, slots, x, tables, out)
        return True

    def run(self) -> torch.Tensor:
        """Every layer's calls on the step :meth:`refresh` pointed at; its output."""
        if self.step_held is None:
            raise RuntimeError("DirectLayers.run() without refresh() for this step")
        out = self.step_held[4]
        lib = _checked(decode_glue._library.lib)
        try:
            if self.silu_in_c:
                code = lib.servelab_decode_layers(self.step_at, self.layers_at, self.count)
                if code != 0:
                    raise ValueError(f"servelab_decode_layers refused layer {-1 - code} that prepare() accepted")
            else:
                self._run_with_torch_silu(lib)
        finally:
            self.step_held = None  # its tensors are the step's: not kept past it
            if self.step.time_attention and _timer is not None:
                _timer[0] += self.step.attention_seconds
        return out

    def _run_with_torch_silu(self, lib: Any) -> None:
        """The layers with torch's SiLU, in place between each layer's two C parts (as
        ``decode_glue.forward``)."""
        attend, down, silu, gate = lib.servelab_decode_layer_attend, lib.servelab_decode_layer_down, \
            torch._C._nn.silu_, self.gate
        step, last = self.step, self.count - 1
        rows_in = step.x
        for i, layer in enumerate(self.layer_at):
            if attend(self.step_at, layer, rows_in) != 0:
                raise ValueError(f"servelab_decode_layer_attend refused layer {i} that prepare() accepted")
            silu(gate)
            down(self.step_at, layer, step.out if i == last else step.between)
            rows_in = step.between


def _layer_args(glue: Any, kv_cache: Any) -> LayerArgs:
    (qkv, qkv_bias), (o, o_bias), (gate_up, gate_up_bias), (down, down_bias) = map(decode_glue._pointers, glue.gemms)
    k_cache, v_cache, k_scale, v_scale = kv_cache
    return LayerArgs(decode_glue._weight(glue.input_norm).data_ptr(), decode_glue._weight(glue.post_norm).data_ptr(),
                     qkv, qkv_bias, o, o_bias, gate_up, gate_up_bias, down, down_bias, k_cache.data_ptr(),
                     v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(), glue.input_norm.eps,
                     glue.post_norm.eps, glue.attention.scale)


def _fixed(glued: list[Any], caches: list[Any]) -> tuple:
    """What the layer structs are made from beside the glued parts' objects, read fresh every step:
    each layer's sizes, window, softmax scale, norms' eps, and its cache tensors' addresses."""
    return tuple((a.num_heads, a.num_kv_heads, a.head_dim, glue.intermediate, glue.hidden, a.sliding_window,
                  a.scale, glue.input_norm.eps, glue.post_norm.eps, *(t.data_ptr() for t in kv_cache))
                 for glue, kv_cache in zip(glued, caches) for a in (glue.attention,))


def _cache_layout(kv_cache: Any) -> tuple:
    return tuple((t.dtype, t.shape, t.stride()) for t in kv_cache)


def _buildable(glued: list[Any], caches: list[Any], fixed: tuple) -> bool:
    """Every layer the first one's sizes and window (the scale may differ), its pages laid out alike."""
    sizes, layout = fixed[0][:6], _cache_layout(caches[0])
    heads, kv_heads, head_dim = sizes[:3]
    return (heads % kv_heads == 0 and tuple(caches[0][0].shape[2:]) == (kv_heads, head_dim)
            and all(f[:6] == sizes for f in fixed) and all(_cache_layout(kv) == layout for kv in caches))


_timer: list[float] | None = None  # timed_attention()'s


@contextlib.contextmanager
def timed_attention() -> Iterator[list[float]]:
    """A benchmark's instrument: inside the block, the prepared layers' C calls time their int8 write
    and attention (two clock reads a layer); yields a one-element list whose ``[0]`` gathers the
    seconds. The calls run from C, so a Python wrapper cannot see them."""
    global _timer
    previous, _timer = _timer, [0.0]
    try:
        yield _timer
    finally:
        _timer = previous


_per_thread = threading.local()  # .prepared: WeakKeyDictionary owner -> DirectLayers


def prepare(owner: Any, glued: list[Any], x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor],
            caches: list[Any], step_attention: Any) -> DirectLayers | None:
    """The layers of ``glued`` (their ``GlueParts``, the second layer's first) with their ``caches``
    as :class:`DirectLayers` refreshed for this step, taking ``x`` float32 ``[rows, hidden]`` (the
    first layer's output), or ``None`` when any condition of the module docstring fails. ``owner``
    (the model's layer list, weakly referenced) keys the kept structs."""
    if (not glued or len(glued) != len(caches) or any(len(kv_cache) != 4 for kv_cache in caches)
            or not hasattr(step_attention, "quantized_decode_step")):
        return None  # float32 pages (no scales), or a step attention without the direct path
    step = step_attention.quantized_decode_step(glued[0].attention.sliding_window)
    slots = step_attention.prepared_slots
    if step is None or slots is None or x.dim() != 2:
        return None
    rows = x.shape[0]
    key = (rows, x.shape[1], cpu_silu.usable(rows, glued[0].intermediate), torch.is_inference_mode_enabled())
    fixed = _fixed(glued, caches)
    kept = getattr(_per_thread, "prepared", None)
    if kept is None:
        kept = _per_thread.prepared = weakref.WeakKeyDictionary()
    direct = kept.get(owner)
    if direct is None or not _reusable(direct, glued, caches, fixed, key):
        kept.pop(owner, None)
        if x.shape[1] != glued[0].hidden or not _buildable(glued, caches, fixed):
            return None
        direct = kept[owner] = DirectLayers(list(glued), caches, fixed, key, rows)
    return direct if direct.refresh(step, slots[0], x, tables, caches[0]) else None


def _reusable(direct: DirectLayers, glued: list[Any], caches: list[Any], fixed: tuple, key: tuple) -> bool:
    return (direct.key == key and direct.fixed == fixed and len(direct.glued) == len(glued)
            and all(a is b for a, b in zip(direct.glued, glued))
            and all(ref() is tensor for refs, kv_cache in zip(direct.cache_refs, caches)
                    for ref, tensor in zip(refs, kv_cache)))
