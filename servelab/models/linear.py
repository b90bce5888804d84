"""Linear layers whose CPU GEMM runs on weights packed once for oneDNN; ``F.linear`` is the reference.

Why: torch's default float32 GEMM on a CPU re-reads each weight in its
checkpoint layout on every call. oneDNN can reorder a weight once into the
blocked layout its micro-kernels stream (``torch.ops.mkldnn._reorder_linear_weight``,
what torch's own Inductor CPU backend does to frozen weights) and then run
every call on it (``torch.ops.mkldnn._linear_pointwise``). On SmolLM2-135M's
shapes on a 2-core AMD EPYC (Zen 4) the decoder's GEMMs took, per forward:

==========  ================  ===========
rows        ``F.linear``      packed
==========  ================  ===========
1           24.7 ms           19.4 ms
16          86.8 ms           50.5 ms
512         1614 ms           1340 ms
==========  ================  ===========

(1 thread; 2 threads 1.5-1.9x at 1-64 rows). That is most of a decode step,
so packing is on by default for float32 models on a CPU. A packed call has
a fixed cost of its own (~15-25 us there), so small weights never go to
oneDNN (:data:`MIN_PACKED_ELEMENTS`).

Few rows (at most :data:`servelab.models.cpu_gemm.MAX_ROWS`: decode steps,
LM heads) go to a second packed form instead, the C kernel's panels
(:mod:`servelab.models.cpu_gemm`), at any weight size: there the weights
stream cold and oneDNN's fixed cost and read rate lose to it by up to 2x.
Small weights (under :data:`MIN_PACKED_ELEMENTS`) go there at every row count
too: on a prefill's 33-512 rows it beat ``F.linear`` on the tiny model's
256x256, 512x256 and 256x768 weights by 20-30% up to 256 rows and 6-15% at
512 (1 thread; 15-45% at 2), where oneDNN's fixed cost keeps them off it.
Only on builds where the kernel is :func:`~servelab.models.cpu_gemm.preferred`.

Numerics: a different GEMM sums in a different order, so results differ
from ``F.linear`` in the last bits (both stay within the float32 error
bound of a ``K``-term dot product; ``tests/models/test_linear.py`` holds
both to it against float64). Greedy tokens are checked against
transformers with packing on.

Memory: the packed copies sit beside the dense weight (which stays the
parameter: state dicts, ``.to()``, weight loading and tied embeddings keep
working), so a layer used with both few and many rows holds its weight three
times. Each copy is made on its first use and remade when the weight changes
(its storage pointer or torch's in-place version counter moved). Turn packing
off per model with :func:`set_weight_packing` (``load_model(...,
pack_weights=False)``).

Refusals: packing applies only where :func:`packing_unavailable_reason`
returns ``None`` (a CPU tensor of a packed dtype, a torch built with
oneDNN); elsewhere, and whenever autograd must see the GEMM, the layer runs
``F.linear`` unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from servelab.models import cpu_gemm

#: dtypes packed. bfloat16/float16 CPU GEMMs already go through oneDNN in
#: torch, and their rounding is held to transformers' bit for bit elsewhere.
PACKED_DTYPES = (torch.float32,)
#: the row count oneDNN picks the blocked layout for (the layout serves
#: every row count; 16 measured as fast as 64 or 512 at those row counts).
BATCH_HINT = 16
#: smallest weight (``out * in`` elements) packed for oneDNN (smaller ones run the panel
#: kernel at every row count where it is preferred, else ``F.linear``): a packed call costs a fixed
#: ~15-25 us more than ``F.linear`` on the machine above, which a weight of
#: 256x256 (16 us at 8 rows) never wins back. From 2^18 elements on, packed
#: was as fast or faster from 2 rows on, and at one row over SmolLM2's whole
#: layer stack (weights streaming from memory, as in a step: 28.8 vs 30.9 ms).
MIN_PACKED_ELEMENTS = 1 << 18


@functools.lru_cache(maxsize=None)
def _ops_unavailable_reason() -> str | None:
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), packed, None, "none", [], "")
    except (AttributeError, RuntimeError, TypeError) as exc:  # an older or different torch
        return f"torch.ops.mkldnn linear packing is not usable here ({type(exc).__name__}: {exc})"
    if out.tolist() != [[2.0, 2.0]]:
        return "torch.ops.mkldnn._linear_pointwise returned a wrong result on a probe"
    return None


def packing_unavailable_reason(dtype: torch.dtype, device: torch.device | str) -> str | None:
    """``None`` when a weight of ``dtype`` on ``device`` can be packed, else why not."""
    if torch.device(device).type != "cpu":
        return f"device {device} is not a CPU (packing is a oneDNN CPU layout)"
    if dtype not in PACKED_DTYPES:
        return f"dtype {dtype} is not packed (packed dtypes: {', '.join(map(str, PACKED_DTYPES))})"
    return _ops_unavailable_reason()


class PackedWeight:
    """The packed copies of one weight (oneDNN's blocked layout, and the few-row kernel's panels),
    each made on first use and remade whenever that weight changes.

    Not a buffer or parameter: derived state, never saved, invisible to
    ``state_dict`` and ``.to()``.
    """

    __slots__ = ("packed", "key", "panels", "panels_key")

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.key: tuple | None = None
        self.panels: torch.Tensor | None = None
        self.panels_key: tuple | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The oneDNN-packed ``weight`` ``[out, in]`` (an opaque oneDNN tensor)."""
        key = (weight.data_ptr(), _version(weight), weight.shape)
        if key != self.key:
            self.packed = None  # drop the stale copy before making the new one (peak memory)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
            self.key = key
        return self.packed  # type: ignore[return-value]

    def get_panels(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[out, in]`` in :func:`servelab.models.cpu_gemm.pack`'s panels ``[ceil(out / W), in, W]``
        (``W``: the loaded build's :func:`~servelab.models.cpu_gemm.panel_width`, part of the key)."""
        key = (weight.data_ptr(), _version(weight), weight.shape, cpu_gemm.panel_width())
        if key != self.panels_key:
            self.panels = None
            self.panels = cpu_gemm.pack(weight)
            self.panels_key = key
        return self.panels  # type: ignore[return-value]

    def clear(self) -> None:
        self.packed, self.key, self.panels, self.panels_key = None, None, None, None


def _version(weight: torch.Tensor) -> int | None:
    try:
        return weight._version
    except RuntimeError:  # an inference-mode tensor has no version counter (and cannot be
        return None       # modified in place outside inference mode)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           cache: PackedWeight | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x ``[..., in]``, weight ``[out, in]``, bias ``[out]`` -> ``[..., out]``.

    With ``cache`` given, ``x``, ``weight`` (and ``bias``) of a packed dtype on a CPU, and
    autograd not recording the op: a 2-D ``x`` of at most :data:`servelab.models.cpu_gemm.MAX_ROWS`
    rows, or any 2-D ``x`` with a weight under :data:`MIN_PACKED_ELEMENTS`, runs the few-row kernel
    on the weight's panels (where :func:`~servelab.models.cpu_gemm.preferred`: AVX-512 and AVX2 + FMA
    builds); otherwise a weight large enough to gain runs oneDNN on its packed copy. Everything
    else, and the reference, is ``F.linear``.
    """
    if cache is not None and x.dim() == 2 and (x.shape[0] <= cpu_gemm.MAX_ROWS
                                               or weight.numel() < MIN_PACKED_ELEMENTS):
        panels = _few_row_panels(x, weight, bias, cache)
        if panels is not None:
            return cpu_gemm._gemm(x, panels, bias, weight.shape[0])
    if (cache is None or x.dtype is not weight.dtype or x.dtype not in PACKED_DTYPES
            or x.device.type != "cpu" or weight.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))
            or (bias is not None and (bias.dtype is not x.dtype or bias.device.type != "cpu"))):
        return F.linear(x, weight, bias)
    if _ops_unavailable_reason() is not None or weight.numel() < MIN_PACKED_ELEMENTS:
        return F.linear(x, weight, bias)  # a small weight never wins back the packed call's fixed cost
    return torch.ops.mkldnn._linear_pointwise(x, cache.get(weight), bias, "none", [], "")


def _few_row_panels(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    cache: PackedWeight) -> torch.Tensor | None:
    """``cache``'s panels of ``weight`` when the panel kernel takes this call (``x`` 2-D with at most
    ``MAX_ROWS`` rows or a small weight, checked by the caller), else ``None``: ``x`` as
    :func:`servelab.models.cpu_gemm.usable` asks, the weight and bias as :func:`weight_panels` does."""
    return weight_panels(weight, bias, cache) if cpu_gemm.usable(x) else None


def weight_panels(weight: torch.Tensor, bias: torch.Tensor | None, cache: PackedWeight) -> torch.Tensor | None:
    """``cache``'s panels of ``weight`` ``[out, in]`` (made on first use) when the panel kernel can
    take this weight and ``bias``, else ``None``: float32 CPU tensors that autograd does not record,
    a contiguous bias, and a build where the kernel is preferred. The conditions of the general
    route in :func:`linear`, in the cheapest tensor queries (``is_cpu`` builds no device object):
    this runs for every linear layer of every decode step (and for every glued layer's four GEMMs,
    :mod:`servelab.models.decode_glue`), where the checks cost as much as a small GEMM.
    """
    if not (weight.dtype is torch.float32 and weight.is_cpu and cpu_gemm.preferred()):
        return None
    if torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    if bias is not None and not (bias.dtype is torch.float32 and bias.is_cpu and bias.is_contiguous()):
        return None
    return cache.get_panels(weight)


class Linear(nn.Linear):
    """``nn.Linear`` that packs its weight on a CPU (see the module docs); same parameters, same state dict.

    Attributes:
        pack_weights: when False, always ``F.linear`` (and the packed copy is dropped).
    """

    @property
    def pack_weights(self) -> bool:
        return self.__dict__.get("_pack_weights", True)

    @pack_weights.setter
    def pack_weights(self, enabled: bool) -> None:
        global _packing_switches
        _packing_switches += 1  # what the decode glue's step memo watches (packing_switches)
        self.__dict__["_pack_weights"] = enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._packed_weight() if self.pack_weights else None)

    def _packed_weight(self) -> PackedWeight:
        cache = self.__dict__.get("_packed")
        if cache is None:
            cache = PackedWeight()
            object.__setattr__(self, "_packed", cache)  # not a submodule, buffer or parameter
        return cache


_packing_switches = 0


def packing_switches() -> int:
    """How many times any :class:`Linear`'s ``pack_weights`` was set in this process."""
    return _packing_switches


def set_weight_packing(model: nn.Module, enabled: bool) -> int:
    """Turn weight packing on or off for every :class:`Linear` in ``model`` (and its LM head,
    when the model declares ``pack_weights``); returns how many layers were set. Turning it
    off frees the packed copies."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__} {enabled!r}")
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack_weights = enabled
            if not enabled:
                module._packed_weight().clear()
            count += 1
    for module in model.modules():  # the LM head (LlamaForCausalLM.lm_head_gemm)
        if hasattr(module, "lm_head_gemm"):
            object.__setattr__(module, "pack_weights", enabled)  # a plain attribute (typed as one)
            cache = module.__dict__.get("_lm_head_packed")
            if cache is not None and not enabled:
                cache.clear()
    return count
