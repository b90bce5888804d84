"""A Llama decoder layer's glue on a decode step in three C calls (``csrc/decode_glue.c``).

Why: on a decode step a small model's layer is a dozen tiny operations (two
RMSNorms, four GEMMs, RoPE, two residual adds, the SwiGLU product). Each is
already one C call or one torch op, but each is reached through a module call,
its checks and an allocation: on the tiny model (hidden 256) that Python was
most of a decode step. Here the same kernels run back to back from C:

=========================================  =====================================
unfused (``LlamaDecoderLayer``'s modules)   glued
=========================================  =====================================
``input_layernorm``, ``qkv_proj``, RoPE     ``servelab_glue_qkv``
cache write, paged attention                the same Python (backends swap there)
``o_proj``, ``+ x``, ``post_attention_      ``servelab_glue_out``
layernorm``, ``gate_up_proj``
SiLU (torch, in place), ``* up``,          ``servelab_glue_down`` (SiLU torch's
``down_proj``, ``+ h``                      where ``cpu_silu.usable`` refuses)
=========================================  =====================================

Same bits: the glue runs only where every unfused step would run the same C
kernel (the RMSNorm whose bits probe passed, the RoPE, the panel GEMM on a
build where it is preferred, at most ``cpu_gemm.MAX_ROWS`` rows), in the same
order, so its output and the K/V it writes equal the unfused layer's bit for
bit (``tests/models/test_decode_glue.py``). SiLU is C's where :mod:`servelab.models.cpu_silu`
found it equal to torch's bit for bit in this process and torch would not split the op
across threads, else torch's own, called between the out and down calls.

When (:func:`parts`): float32 CPU rows outside autograd, tracing and
compilation; the layer's parts exactly servelab's classes (a researcher who
swaps ``layer.mlp`` for their own module gets their module called), none with
a hook, no global module hook, weight packing on. Anything else runs the
unfused modules; ``SERVELAB_CPU_KERNELS=0`` turns it off with the other kernels.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

import torch
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle

from servelab.attention import cpu_decode
from servelab.models import cpu_gemm, cpu_norm, cpu_rope, cpu_silu
from servelab.models import linear as linear_module
from servelab.models.layers import RMSNorm, SwiGLUMLP
from servelab.models.linear import Linear, weight_panels

_library = cpu_decode.LibraryOnce()  # the hot path calls _library.lib


class GlueParts(NamedTuple):
    """What :func:`forward` reads from one layer (its own modules, checked by :func:`parts`)."""

    attention: Any  # the layer's LlamaAttention (sizes, scale, window; its attend())
    input_norm: RMSNorm
    post_norm: RMSNorm
    gemms: tuple[tuple[torch.Tensor, torch.Tensor | None], ...]  # (panels, bias): QKV, O, gate_up, down
    intermediate: int
    hidden: int  # the width of the rows it takes (its norms' weights)


def _no_global_hooks() -> bool:
    m = _torch_module
    return not (m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


def parts(layer: torch.nn.Module, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor],
          attention_type: Any) -> GlueParts | None:
    """``layer``'s parts when its decode step can run glued on ``x`` ``[rows, hidden]`` with the step's
    RoPE ``tables`` (``StepAttention.rope_tables``), else ``None``.

    ``attention_type``: the attention class the glue knows (the caller's, ``LlamaAttention``).
    Each kernel's conditions are asked of its own module (``cpu_gemm.usable``,
    ``linear.weight_panels``, ``cpu_norm.usable``, ``cpu_rope.tables_usable``); the rest are the
    module docstring's. This runs once per layer and step, where asking everything cost ~27 us
    of Python a layer (~55 us inside a step, a tenth of a small model's decode step), so what
    depends on the layer alone is asked once and kept with the layer's :func:`_layer_state`
    (asked again when that changes), and the tables' answer is kept for the step's tables.
    """
    return _layer_glue(layer, x, tables, attention_type) if _step_glues(x) else None


def _step_glues(x: torch.Tensor) -> bool:
    """:func:`parts`' conditions that depend on the rows ``x`` and the process alone, not the layer
    (asked once per step by :func:`step_parts`: ~5 us of each layer's Python when asked per layer)."""
    return (0 < x.shape[0] <= cpu_gemm.MAX_ROWS and x.is_contiguous() and cpu_gemm.usable(x)
            and not torch.is_grad_enabled() and _library() is not None and _no_global_hooks()
            and not torch._C._get_tracing_state() and not torch.compiler.is_compiling())


def _layer_glue(layer: torch.nn.Module, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor],
                attention_type: Any) -> GlueParts | None:
    """:func:`parts` for rows ``x`` that :func:`_step_glues` accepted: the layer's own conditions."""
    held = _layer_state(layer, attention_type)
    if held is None:
        return None
    state = tuple(map(id, held[0])) + held[1]  # ids: stable while the memo holds the objects
    memo = _memo.get(layer)
    if memo is None or memo[0] != state:
        memo = _memo[layer] = (state, _layer_parts(layer), held[0])
    glue: GlueParts | None = memo[1]
    # x is a contiguous float32 CPU [rows, K] outside autograd (above): cpu_norm.usable's conditions
    # on it are its width, which _layer_parts asked of the norms' weights.
    if glue is None or x.shape[1] != glue.hidden or not _tables_usable(tables, x.shape[0], glue.attention.head_dim):
        return None
    return glue


def step_parts(layers: Any, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], layer_type: Any,
               attention_type: Any) -> list[GlueParts] | None:
    """Every layer's :func:`parts`, asked before the first layer runs, when all of them glue and
    each is exactly ``layer_type`` (whose ``forward`` is the glue's caller); else ``None`` (each
    layer asks for itself). The model then calls :func:`forward` for each layer directly, which is
    what the layer's own module call would reach: :func:`parts` has checked that no module or
    global hook is set, and every later layer's rows are the glue's own output, of the shape asked.

    Why: asked between layers, where the caches hold the layer's just-streamed weights instead of
    the interpreter's objects, :func:`parts` took ~65 us of each SmolLM2 layer on its batch-16 decode
    step (~8 us asked back to back), and the module call around it more: ~2 ms of a 92 ms step.

    Asked again on the next step with nothing changed, the answer is the last one
    (:func:`_unchanged`): asking every layer's modules again cost ~0.6-0.8 ms of that step (every
    object cold after the weights' stream), the same check over the weights alone ~0.1 ms."""
    if not _step_glues(x):
        return None
    _watch_modules()
    key = (*_structure_generation(), cpu_gemm.preferred(), cpu_gemm.panel_width(), x.shape[1],
           tuple(map(id, layers)))
    held = _step_memo.get(layers)
    if held is not None and _unchanged(held, key, layers, x.shape[0], tables, layer_type):
        return held.glued
    glued = []
    for layer in layers:
        if type(layer) is not layer_type:
            return None
        glue = _layer_glue(layer, x, tables, attention_type)
        if glue is None:
            return None
        glued.append(glue)
    objects = [_memo[layer][2] for layer in layers]  # _layer_state's: 8 modules, 2 norm weights, 4 (weight, bias)
    modules = tuple(module for held in objects for module in held[:8])
    weights = tuple(t for held in objects for t in held[8:] if t is not None)
    _step_memo[layers] = _StepMemo(key, glued, modules, tuple(map(type, modules)), weights, _stamps(weights),
                                   tuple(sorted({glue.attention.head_dim for glue in glued})))
    return glued


class _StepMemo(NamedTuple):
    """:func:`step_parts`' last answer for one layer list, and what it must find unchanged to give it again."""

    key: tuple  # the module tree's generations, the panel kernel's traits, the rows' width, the layers' ids
    glued: list[GlueParts]
    modules: tuple[torch.nn.Module, ...]  # every layer's attention, MLP, norms and linears
    types: tuple[type, ...]  # their classes then
    weights: tuple[torch.Tensor, ...]  # every glued layer's norm weights, GEMM weights and biases
    stamps: tuple  # their (data pointer, in-place version) then
    head_dims: tuple[int, ...]  # the layers' head sizes (the RoPE tables' check)


# a layer list (the model's ModuleList) -> its _StepMemo
_step_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _unchanged(held: _StepMemo, key: tuple, layers: Any, rows: int, tables: tuple[torch.Tensor, torch.Tensor],
               layer_type: Any) -> bool:
    """Whether :func:`step_parts`' last answer for ``layers`` still holds: what :func:`_layer_state`
    asks of each layer's modules changes only through a new hook, a new submodule, parameter or
    buffer, or a packing switch (:func:`_structure_generation` counts them all) or a class
    assignment (every layer's and part's class is asked again); the weights' and biases' data
    through their pointer and version (asked again: :func:`_layer_state` asks the same, except the
    norms' and biases' versions, whose values are read at every call); the RoPE tables are the step's.
    Not seen: edits of a module's private dicts (``_modules``, ``_forward_hooks``, ...) that bypass
    torch's public calls; after any public change the full check runs again."""
    return (held.key == key and all(type(layer) is layer_type for layer in layers)
            and all(type(module) is kind for module, kind in zip(held.modules, held.types))
            and _stamps(held.weights) == held.stamps
            and all(_tables_usable(tables, rows, head_dim) for head_dim in held.head_dims))


def _stamps(weights: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((weight.data_ptr(), _version(weight)) for weight in weights)


_registrations = [0]  # submodules, parameters and buffers assigned since _watch_modules (any module)
_watching: list = []  # the registration hooks' handles, once installed


def _count_registration(*args: Any) -> None:
    _registrations[0] += 1  # returns None: the assignment goes on unchanged


def _watch_modules() -> None:
    """Install, once per process, torch's global registration hooks that count every submodule,
    parameter and buffer assignment to any module (they change nothing else)."""
    if not _watching:
        _watching.extend((_torch_module.register_module_module_registration_hook(_count_registration),
                          _torch_module.register_module_parameter_registration_hook(_count_registration),
                          _torch_module.register_module_buffer_registration_hook(_count_registration)))


def _structure_generation() -> tuple[int, int, int]:
    """Counters that rise with every change :func:`_layer_state` could see in a module tree: hooks
    (every public registration makes a ``RemovableHandle``, whose class counts them), assignments of
    submodules, parameters and buffers (:func:`_watch_modules`), and ``Linear.pack_weights`` switches."""
    return RemovableHandle.next_id, _registrations[0], linear_module.packing_switches()


# layer -> (its state when last asked, its GlueParts or None, the objects the state names by id)
_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layer_state(layer: torch.nn.Module, attention_type: Any) -> tuple[tuple, tuple] | None:
    """What :func:`_layer_parts` reads from ``layer``, in cheap queries (dict lookups, no module
    ``__getattr__``), as (the objects, compared by identity; the values), or ``None`` when the
    layer is not one the glue knows: its parts exactly servelab's classes, packing on, none with
    a hook. Values: the panel kernel's build traits, each GEMM weight's data pointer and in-place
    version (its panels are a copy), and the norms' weights' and the biases' data pointers (their
    values are read at every call, but whether the kernels take them, their dtype and layout, was
    asked once: a ``.data`` assignment gives a new pointer)."""
    m: dict[str, Any] = layer._modules
    attn: Any = m.get("self_attn")
    mlp: Any = m.get("mlp")
    n1, n2 = m.get("input_layernorm"), m.get("post_attention_layernorm")
    if (type(attn) is not attention_type or type(mlp) is not SwiGLUMLP or type(n1) is not RMSNorm
            or type(n2) is not RMSNorm):
        return None
    linears: tuple[Any, ...] = (attn._modules.get("qkv_proj"), attn._modules.get("o_proj"),
                                mlp._modules.get("gate_up_proj"), mlp._modules.get("down_proj"))
    if not all(type(lin) is Linear and lin.pack_weights for lin in linears):
        return None
    mods: tuple[Any, ...] = (layer, attn, mlp, n1, n2, *linears)
    for mod in mods:
        if mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks or mod._backward_pre_hooks:
            return None
    objects: list[Any] = [attn, mlp, n1, n2, *linears, _weight(n1), _weight(n2)]
    values: list[Any] = [cpu_gemm.preferred(), cpu_gemm.panel_width(), _weight(n1).data_ptr(), _weight(n2).data_ptr()]
    for lin in linears:
        params = lin._parameters
        weight, bias = params["weight"], params.get("bias")
        objects += (weight, bias)
        values += (weight.data_ptr(), _version(weight), None if bias is None else bias.data_ptr())
    return tuple(objects), tuple(values)


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference-mode tensor keeps no version (and cannot change in place outside it)
        return None


def _layer_parts(layer: torch.nn.Module) -> GlueParts | None:
    """The :class:`GlueParts` of a layer :func:`_layer_state` accepted, or ``None`` when a weight or
    bias is not one the panel kernel takes (``linear.weight_panels``) or a norm's weight is not one
    the norm kernel takes (``cpu_norm.usable``, asked with a row of the width the glue will pass)."""
    m: dict[str, Any] = layer._modules
    attn, mlp, n1, n2 = m["self_attn"], m["mlp"], m["input_layernorm"], m["post_attention_layernorm"]
    hidden = _weight(n1).shape[0]
    row = torch.empty(1, hidden, dtype=torch.float32, device="cpu")
    if attn.head_dim % 2 or not all(cpu_norm.usable(row, _weight(n)) for n in (n1, n2)):
        return None
    gemms = []
    for lin in (attn._modules["qkv_proj"], attn._modules["o_proj"], mlp._modules["gate_up_proj"],
                mlp._modules["down_proj"]):
        weight, bias = _weight(lin), lin._parameters.get("bias")
        panels = weight_panels(weight, bias, lin._packed_weight())
        if panels is None:
            return None
        gemms.append((panels, bias))
    return GlueParts(attn, n1, n2, tuple(gemms), mlp.intermediate_size, hidden)


def _tables_usable(tables: tuple[torch.Tensor, torch.Tensor], rows: int, head_dim: int) -> bool:
    """``cpu_rope.tables_usable``, its answer kept for the last tables asked (the step's, the same
    tensors for every layer) in this thread."""
    last = getattr(_thread_scratch, "tables", None)
    if last is not None and last[0] is tables[0] and last[1] is tables[1] and last[2] == (rows, head_dim):
        return last[3]
    ok = cpu_rope.tables_usable(*tables, rows, head_dim)
    _thread_scratch.tables = (tables[0], tables[1], (rows, head_dim), ok)
    return ok


def _weight(module: torch.nn.Module) -> Any:
    return module._parameters["weight"]  # the parameter dict: no module __getattr__ on the hot path


def _pointers(gemm: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[int, int | None]:
    panels, bias = gemm
    return panels.data_ptr(), None if bias is None else bias.data_ptr()


def _new(*shape: int) -> torch.Tensor:
    """A float32 CPU buffer for a C kernel's output (never torch's default dtype or device)."""
    return torch.empty(shape, dtype=torch.float32, device="cpu")


_thread_scratch = threading.local()
_SCRATCH_SIZES = 64


def _scratch(rows: int, hidden: int, gate_up: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``normed`` / ``h`` ``[rows, hidden]`` and ``gate_up`` ``[rows, gate_up]`` float32: :func:`forward`'s
    temporaries that never leave it (q, k, v and the output are fresh tensors), kept per thread and
    per size and reused by every later call, so a step's layers allocate them once (three
    allocations were ~25 us of a layer inside a SmolLM2 step). None is live while the layer's
    attention runs (user code there may call a glued layer of its own): ``normed`` is last read by
    the QKV GEMM, ``h`` and ``gate_up`` are first written after it. At most :data:`_SCRATCH_SIZES`
    sizes are kept (a serving loop's batch size wanders; the model's widths do not)."""
    sizes: dict | None = getattr(_thread_scratch, "sizes", None)
    if sizes is None:
        sizes = _thread_scratch.sizes = {}
    # Inference mode in the key: a tensor made under it cannot be updated in place outside it
    # (SiLU is in place), and one made outside it would be a normal tensor inside it.
    key = (rows, hidden, gate_up, torch.is_inference_mode_enabled())
    cached = sizes.get(key)
    if cached is None:
        if len(sizes) >= _SCRATCH_SIZES:
            sizes.clear()
        cached = sizes[key] = (_new(rows, hidden), _new(rows, hidden), _new(rows, gate_up))
    return cached


def forward(glue: GlueParts, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
            kv_cache: tuple[torch.Tensor, torch.Tensor], step_attention: Any) -> torch.Tensor:
    """The layer on ``x`` float32 ``[rows, hidden]`` -> a new ``[rows, hidden]``, writing this step's
    K/V into ``kv_cache`` through ``step_attention`` (the model's per-step attention view).

    ``cos`` / ``signed_sin``: the step's RoPE tables ``[rows, 1, head_dim]``, views of contiguous
    ``[rows, head_dim]`` (``StepAttention.rope_tables``)."""
    lib, threads = _library.lib, torch.get_num_threads()
    attn = glue.attention
    rows, hidden = x.shape
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv_size = attn.q_size + 2 * attn.kv_size
    normed, h, gate_up = _scratch(rows, hidden, 2 * glue.intermediate)
    qkv, qk = _new(rows, qkv_size), _new(rows, heads + kv_heads, head_dim)
    (panels, bias), (o_panels, o_bias), (gu_panels, gu_bias), (down_panels, down_bias) = map(_pointers, glue.gemms)
    lib.servelab_glue_qkv(x.data_ptr(), _weight(glue.input_norm).data_ptr(), glue.input_norm.eps,
                          normed.data_ptr(), panels, bias, qkv.data_ptr(), qk.data_ptr(), cos.data_ptr(),
                          signed_sin.data_ptr(), rows, hidden, qkv_size, heads + kv_heads, head_dim, threads)
    v = qkv[:, attn.q_size + attn.kv_size:].view(rows, kv_heads, head_dim)
    out = attn.attend(qk[:, :heads], qk[:, heads:], v, kv_cache, step_attention).reshape(rows, attn.q_size)
    if out.stride(1) != 1:
        out = out.contiguous()
    lib.servelab_glue_out(out.data_ptr(), out.stride(0), o_panels, o_bias, x.data_ptr(), h.data_ptr(),
                          _weight(glue.post_norm).data_ptr(), glue.post_norm.eps, normed.data_ptr(),
                          gu_panels, gu_bias, gate_up.data_ptr(), rows, attn.q_size, hidden,
                          2 * glue.intermediate, threads)
    silu_in_c = cpu_silu.usable(rows, glue.intermediate)
    if not silu_in_c:
        # torch's SiLU kernel, in place: what F.silu(..., inplace=True) calls after ~8 us of Python
        # (its torch-function and inplace dispatch) that the glue's plain float32 view never needs.
        torch._C._nn.silu_(gate_up[:, : glue.intermediate])
    y = _new(rows, hidden)
    lib.servelab_glue_down(gate_up.data_ptr(), glue.intermediate, silu_in_c, down_panels, down_bias, h.data_ptr(),
                           y.data_ptr(), rows, hidden, threads)
    return y
