"""Memory layout: one flat int8 buffer, carved into per-layer cache views.

The pool hands out block *ids*; this module decides where block ``b`` of layer
``l`` lives in bytes. All layers share one allocation (one ``torch.empty``,
one free, one registration with a transfer engine), and each layer sees its
part through ``torch.as_strided`` views — no copies, writes through a view land
in the buffer.

Two orders of the same bytes:

``"layer_outermost"`` (vLLM's default)::

    [layer][K|V][block][token][head][dim]
    each layer's K (and V) cache is one contiguous [num_blocks, block_size, H, D]
    tensor (vLLM's flash layout); best for kernels that read one layer at a time.

``"block_outermost"``::

    [block][layer][K|V][token][head][dim]
    all layers of one block are contiguous: moving a block between devices or
    hosts (KV offload, disaggregated prefill) is one memcpy per block.

Attention views have the NHD shape the kernels take, ``[num_blocks,
block_size, num_kv_heads, head_size]``, as ``(key_cache, value_cache)``; MLA has
only the latent cache ``[num_blocks, block_size, head_size]``; Mamba has one
``[num_blocks, *shape]`` view per state tensor.

Kernel block size: a kernel may want smaller blocks than the manager's (e.g.
manager blocks of 64 tokens read as 16-token kernel blocks). With
``kernel_block_size`` the views become ``[num_blocks * ratio,
kernel_block_size, ...]`` and manager block ``b`` is kernel blocks
``b*ratio .. b*ratio + ratio - 1`` (see :func:`expand_block_table`). That needs
the sub-blocks of consecutive blocks to be equally spaced, which holds for
``"layer_outermost"`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelab._internal.validation import check_int
from servelab.blocks.specs import AttentionSpec, KVCacheSpec, MambaSpec, MLAAttentionSpec

LAYOUTS = ("layer_outermost", "block_outermost")


@dataclass
class KVCacheBuffers:
    """The flat buffer and its per-layer views (``views[layer]`` is a tuple of tensors)."""

    buffer: torch.Tensor
    views: list[tuple[torch.Tensor, ...]]
    layout: str
    kernel_block_size: int
    #: float32 ``[num_layers, 2, num_kv_heads]``: the K and V scales of a quantized cache with
    #: static (``"tensor"`` / ``"head"``) scales, which every block of a layer shares (its views'
    #: third and fourth tensors are stride-0 expansions of them); None otherwise.
    static_scales: torch.Tensor | None = None


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return strides[::-1]


def _view(buffer: torch.Tensor, dtype: torch.dtype, shape, strides_bytes, offset_bytes: int) -> torch.Tensor:
    """A ``dtype`` view of the int8 ``buffer`` with strides and offset in bytes."""
    size = _itemsize(dtype)
    # as_strided works in elements of the viewed dtype; layouts are built so
    # that every byte stride/offset is a multiple of the itemsize.
    return buffer.view(dtype).as_strided(
        tuple(shape), tuple(s // size for s in strides_bytes), offset_bytes // size
    )


def allocate_kv_cache(
    spec: KVCacheSpec,
    num_layers: int,
    num_blocks: int,
    *,
    layout: str = "layer_outermost",
    kernel_block_size: int | None = None,
    device: torch.device | str = "cpu",
    zero_fill: bool = True,
) -> KVCacheBuffers:
    """Allocate one int8 buffer for ``num_layers`` layers of ``num_blocks``
    blocks each, and return it with per-layer views (see module docstring).

    ``zero_fill=False`` leaves every block but the null block 0 uninitialized
    (``torch.empty``): no up-front pass over the whole pool, and on a CPU the
    operating system maps a large buffer's pages only when first written, so
    resident memory grows with the blocks actually used. That is safe for
    readers that never let an unwritten slot reach a result (the attention
    backends read positions below ``seq_len`` only, or mask their loads);
    block 0 stays zeroed because block tables point padding and
    out-of-window blocks at it and a reference may read it under a mask,
    where ``0 * NaN`` garbage would still be NaN.
    """
    check_int("num_layers", num_layers, min_value=1)
    check_int("num_blocks", num_blocks, min_value=1)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not known; valid: {LAYOUTS}")
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
    alloc = torch.zeros if zero_fill else torch.empty
    buffer = alloc(num_layers * num_blocks * spec.page_size_bytes, dtype=torch.int8, device=device)
    views = layer_views(buffer, spec, num_layers, num_blocks, layout=layout, kernel_block_size=kernel_block_size)
    kbs = spec.block_size if kernel_block_size is None else kernel_block_size
    if not zero_fill:
        # The null block: its first ``block_size / kernel_block_size`` kernel blocks (one row for Mamba).
        rows = 1 if isinstance(spec, MambaSpec) else spec.block_size // kbs
        for layer in views:
            for view in layer:
                view[:rows].zero_()
    static = None
    if isinstance(spec, AttentionSpec) and spec.kv_scale in ("tensor", "head"):
        views, static = with_static_scales(views, spec, device)
    return KVCacheBuffers(buffer, views, layout, kbs, static)


def with_static_scales(views: list[tuple[torch.Tensor, ...]], spec: AttentionSpec, device: torch.device | str
                       ) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
    """Each layer's ``(key_cache, value_cache)`` with ``(k_scale, v_scale)`` appended: stride-0
    ``[N, B, Hk]`` expansions of one float32 ``[num_layers, 2, Hk]`` tensor (all ones: vLLM's
    default until calibrated), which is returned too."""
    static = torch.ones((len(views), 2, spec.num_kv_heads), dtype=torch.float32, device=device)
    out = []
    for layer, (key_cache, value_cache) in enumerate(views):
        shape = tuple(key_cache.shape[:3])
        out.append((key_cache, value_cache, static[layer, 0].expand(shape), static[layer, 1].expand(shape)))
    return out, static


def layer_views(
    buffer: torch.Tensor,
    spec: KVCacheSpec,
    num_layers: int,
    num_blocks: int,
    *,
    layout: str = "layer_outermost",
    kernel_block_size: int | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """Per-layer views over an existing flat int8 ``buffer`` (see module docstring)."""
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.int8 or buffer.dim() != 1:
        raise ValueError("buffer must be a 1-D torch.int8 tensor")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not known; valid: {LAYOUTS}")
    page = spec.page_size_bytes
    if buffer.numel() < num_layers * num_blocks * page:
        raise ValueError(
            f"buffer has {buffer.numel()} bytes; {num_layers} layers x {num_blocks} blocks x "
            f"{page} bytes/page need {num_layers * num_blocks * page}"
        )
    bs = spec.block_size
    kbs = bs if kernel_block_size is None else kernel_block_size
    check_int("kernel_block_size", kbs, min_value=1)
    if bs % kbs:
        raise ValueError(
            f"kernel_block_size={kernel_block_size!r} must be a positive divisor of block_size={bs}"
        )
    if kbs != bs and layout != "layer_outermost":
        raise ValueError(
            f"kernel_block_size={kbs} < block_size={bs} cannot be expressed with layout={layout!r}: "
            "consecutive blocks are a whole multi-layer page apart, so sub-blocks are not equally "
            "spaced; use layout='layer_outermost' or kernel_block_size=block_size"
        )
    if isinstance(spec, MambaSpec) and kbs != bs:
        raise ValueError("kernel_block_size does not apply to MambaSpec (one state per block)")
    return [_one_layer(buffer, spec, layer, num_layers, num_blocks, layout, kbs) for layer in range(num_layers)]


def _one_layer(buffer, spec, layer: int, num_layers: int, num_blocks: int, layout: str,
               kbs: int) -> tuple[torch.Tensor, ...]:
    page = spec.page_size_bytes
    if isinstance(spec, MambaSpec):
        if layout == "layer_outermost":
            base, block_stride = layer * num_blocks * page, page
        else:
            base, block_stride = layer * page, num_layers * page
        views = []
        for shape, dtype, offset in zip(spec.shapes, spec.dtypes, spec.state_offsets_bytes):
            inner = [s * _itemsize(dtype) for s in _contiguous_strides(shape)]
            views.append(_view(buffer, dtype, (num_blocks, *shape), [block_stride, *inner], base + offset))
        return tuple(views)
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"no memory layout is defined for {type(spec).__name__}")
    isz = _itemsize(spec.dtype)
    heads = spec.num_kv_heads
    token_bytes = heads * spec.head_size * isz
    tensor_bytes = spec.block_size * token_bytes  # one block of K (or of V, or of latent)
    if layout == "layer_outermost":
        # [layer][K|V][block][token]: K of all blocks, then V of all blocks.
        base, block_stride, next_tensor = layer * num_blocks * page, tensor_bytes, num_blocks * tensor_bytes
    else:
        # [block][layer][K|V][token]: a block's page holds every layer.
        base, block_stride, next_tensor = layer * page, num_layers * page, tensor_bytes
    ratio = spec.block_size // kbs
    shape = (num_blocks * ratio, kbs, heads, spec.head_size)
    strides = [block_stride // ratio, token_bytes, spec.head_size * isz, isz]
    views = tuple(_view(buffer, spec.dtype, shape, strides, base + t * next_tensor) for t in range(spec.num_tensors))
    if isinstance(spec, MLAAttentionSpec):
        if spec.kv_scale == "token_head":
            raise ValueError("kv_scale='token_head' is not laid out for MLAAttentionSpec")
        return (views[0].squeeze(2),)
    scale_bytes = spec.scale_bytes_per_tensor
    if scale_bytes:
        # The scales follow the data: [layer][K|V|K scales|V scales][block] (layer_outermost) or
        # [block][layer][K|V|K scales|V scales] (block_outermost), float32 [N, B, Hk] each.
        if layout == "layer_outermost":
            scale_base, scale_stride, next_scale = base + 2 * num_blocks * tensor_bytes, scale_bytes, \
                num_blocks * scale_bytes
        else:
            scale_base, scale_stride, next_scale = base + 2 * tensor_bytes, block_stride, scale_bytes
        scale_shape = (num_blocks * ratio, kbs, heads)
        scale_strides = [scale_stride // ratio, heads * 4, 4]
        scales = [_view(buffer, torch.float32, scale_shape, scale_strides, scale_base + t * next_scale)
                  for t in range(2)]
        return (*views, *scales)
    return views


def expand_block_table(block_table: torch.Tensor, ratio: int) -> torch.Tensor:
    """Manager block ids ``[num_seqs, n]`` -> kernel block ids ``[num_seqs, n * ratio]``
    (block ``b`` becomes ``b*ratio, ..., b*ratio + ratio - 1``)."""
    check_int("ratio", ratio, min_value=1)
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D [num_seqs, max_blocks], got shape {tuple(block_table.shape)}")
    offsets = torch.arange(ratio, dtype=block_table.dtype, device=block_table.device)
    return (block_table.unsqueeze(-1) * ratio + offsets).flatten(1)
