"""Static KV-cache scales from real activations: ``calibrate_kv_scales(pipe, prompts)``.

A quantized cache with ``kv_cache_scale="tensor"`` or ``"head"`` reads every page with one
scale per layer (and KV head) for K and for V, 1.0 until set (vLLM's default, which
saturates or flattens most models' K/V). Calibration runs the prompts through the model
over a cache of its own in the model's dtype (the pipeline's pages are not touched), takes
each layer's largest ``|K|`` and ``|V|`` per KV head over every written position, and
sets ``scale = amax / max_value`` of the format (per head, or the layer's maximum over
heads for ``"tensor"``) in ``pipe.kv_caches.static_scales``. Values beyond the calibrated
range saturate at ``±max_value * scale`` when written.

:func:`save_kv_scales` / :func:`load_kv_scales` keep the scales in a file; loading checks
it against the pipeline (layers, KV heads, format, granularity) and refuses a mismatch
with a ``ValueError`` naming what differs, before anything is written.

:func:`calibrate_key_smoothing` (any granularity, best with ``"token_head"``) measures each key
channel's largest ``|K|`` the same way and folds the factors of
:func:`servelab.blocks.kv_quant.key_smoothing_factors` into the model's query / key weights
(:func:`fold_key_smoothing`): K is written divided by them, the query multiplied, so every
attention path reads the pages as before and ``q . k`` is unchanged up to float rounding.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from servelab.blocks.kv_quant import get_kv_cache_dtype, key_smoothing_factors
from servelab.models import allocate_kv_caches, prepare_inputs

__all__ = ["calibrate_key_smoothing", "calibrate_kv_scales", "fold_key_smoothing", "load_kv_scales",
           "measure_key_channel_amax", "save_kv_scales", "smooth_model_keys"]


def _static_scales(pipe: Any) -> torch.Tensor:
    static = getattr(pipe.kv_caches, "static_scales", None)
    cache = pipe.config.cache
    if static is None:
        raise ValueError(f"kv_cache_scale={cache.kv_cache_scale!r} with kv_cache_dtype={cache.kv_cache_dtype!r} "
                         "has no static scales to calibrate; valid: a quantized kv_cache_dtype with "
                         "kv_cache_scale='tensor' or 'head' ('token_head' scales are computed as tokens are written)")
    if pipe.has_unfinished_requests():
        raise ValueError("calibrate or load KV scales before serving: this pipeline has unfinished requests, whose "
                         "pages were quantized with the current scales")
    return static


def _tokens(pipe: Any, prompt: str | Sequence[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(pipe.tokenizer.encode(prompt))
    return [int(t) for t in prompt]


def _written_kv(model: Any, prompts: Sequence[Sequence[int]], block_size: int, max_tokens: int):
    """Per prompt (each cut to ``max_tokens``), per layer: the ``(K, V)`` it wrote, ``[n, Hk, D]`` each,
    one prompt per forward over a fresh cache in the model's dtype."""
    for tokens in prompts:
        tokens = list(tokens)[:max_tokens]
        if not tokens:
            continue
        num_blocks = -(-len(tokens) // block_size) + 1
        caches = allocate_kv_caches(model, num_blocks, block_size)
        ids, pos, meta = prepare_inputs([tokens], [0], [list(range(1, num_blocks))], block_size)
        model(ids, pos, caches, meta)
        yield [tuple(cache[1:].reshape(-1, *cache.shape[2:])[: len(tokens)] for cache in view[:2])
               for view in caches.views]


@torch.no_grad()
def measure_kv_amax(model: Any, prompts: Sequence[Sequence[int]], *, block_size: int = 16,
                    max_tokens: int = 2048) -> torch.Tensor:
    """float32 ``[num_layers, 2, num_kv_heads]``: the largest ``|K|`` and ``|V|`` each layer writes
    per KV head over ``prompts`` (token lists, each cut to ``max_tokens``), one prompt per forward
    over a fresh cache in the model's dtype."""
    cfg = model.config
    amax = torch.zeros((cfg.num_hidden_layers, 2, cfg.num_key_value_heads), dtype=torch.float32)
    for layers in _written_kv(model, prompts, block_size, max_tokens):
        for layer, written in enumerate(layers):
            for t, x in enumerate(written):
                amax[layer, t] = torch.maximum(amax[layer, t], x.abs().amax(dim=(0, 2)).float())
    return amax


@torch.no_grad()
def measure_key_channel_amax(model: Any, prompts: Sequence[Sequence[int]], *, block_size: int = 16,
                             max_tokens: int = 2048) -> torch.Tensor:
    """float32 ``[num_layers, num_kv_heads, head_dim]``: the largest ``|K|`` of each key channel (after
    RoPE, as written) per layer and KV head over ``prompts`` (as :func:`measure_kv_amax`)."""
    cfg = model.config
    amax = torch.zeros((cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim), dtype=torch.float32)
    for layers in _written_kv(model, prompts, block_size, max_tokens):
        for layer, (k, _) in enumerate(layers):
            amax[layer] = torch.maximum(amax[layer], k.abs().amax(dim=0).float())
    return amax


def calibrate_kv_scales(pipe: Any, prompts: Sequence[str | Sequence[int]], *, max_tokens: int = 2048
                        ) -> torch.Tensor:
    """Fill ``pipe``'s static K/V scales from ``prompts`` (texts or token lists); returns them,
    float32 ``[num_layers, 2, num_kv_heads]`` (``[:, 0]`` K, ``[:, 1]`` V). The prefix cache is
    reset (its pages were quantized with the old scales)."""
    static = _static_scales(pipe)
    if not prompts:
        raise ValueError("prompts is empty; give at least one text or token list to calibrate on")
    fmt = get_kv_cache_dtype(pipe.config.cache.kv_cache_dtype)
    amax = measure_kv_amax(pipe.model, [_tokens(pipe, p) for p in prompts], max_tokens=max_tokens)
    if pipe.config.cache.kv_cache_scale == "tensor":
        amax = amax.amax(dim=2, keepdim=True).expand_as(amax)
    scales = torch.where(amax > 0, amax / fmt.max_value, torch.ones_like(amax))
    _install(pipe, static, scales)
    return scales.clone()


def _install(pipe: Any, static: torch.Tensor, scales: torch.Tensor) -> None:
    static.copy_(scales.to(static.device))
    pipe.model.reset_attention_state()
    reset = getattr(pipe.kv_cache_manager, "reset_prefix_cache", None)
    if reset is not None:
        reset()


def save_kv_scales(pipe: Any, path: str | os.PathLike) -> None:
    """Write ``pipe``'s static scales with what they were made for (format, granularity, shape)."""
    static = _static_scales(pipe)
    cache = pipe.config.cache
    torch.save({"scales": static.cpu().clone(), "kv_cache_dtype": cache.kv_cache_dtype,
                "kv_cache_scale": cache.kv_cache_scale}, os.fspath(path))


def load_kv_scales(pipe: Any, path: str | os.PathLike) -> torch.Tensor:
    """Set ``pipe``'s static scales from a :func:`save_kv_scales` file, checked against the pipeline
    first (``ValueError`` naming the mismatch; nothing written)."""
    static = _static_scales(pipe)
    try:
        saved = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"kv scales file {os.fspath(path)!r} cannot be read: {err}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("scales"), torch.Tensor):
        raise ValueError(f"kv scales file {os.fspath(path)!r} holds no 'scales' tensor; valid: a save_kv_scales file")
    scales, cache = saved["scales"], pipe.config.cache
    if tuple(scales.shape) != tuple(static.shape):
        raise ValueError(f"kv scales file {os.fspath(path)!r} has scales of shape {tuple(scales.shape)}; this model "
                         f"needs [num_layers, 2, num_kv_heads] = {tuple(static.shape)}")
    for name in ("kv_cache_dtype", "kv_cache_scale"):
        if saved.get(name) != getattr(cache, name):
            raise ValueError(f"kv scales file {os.fspath(path)!r} was made for {name}={saved.get(name)!r}; this "
                             f"pipeline has {name}={getattr(cache, name)!r}")
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise ValueError(f"kv scales file {os.fspath(path)!r} holds a scale that is not finite and > 0")
    _install(pipe, static, scales.to(torch.float32))
    return scales


def _fold_norms(attn: Any, f: torch.Tensor) -> None:
    """``f`` float64 ``[D]`` into per-head ``q_norm`` / ``k_norm`` gains: the query's times ``f``, the
    key's over ``f`` (a Gemma norm's gain is ``1 + weight``, a plain RMSNorm's ``weight``)."""
    from servelab.models.gemma2 import GemmaRMSNorm

    for norm, factor in ((attn.q_norm, f), (attn.k_norm, 1.0 / f)):
        w = norm.weight
        if isinstance(norm, GemmaRMSNorm):
            w.copy_(((1.0 + w.double()) * factor - 1.0).to(w.dtype))
        else:
            w.copy_((w.double() * factor).to(w.dtype))


def _fold_qkv(attn: Any, f: torch.Tensor) -> None:
    """``f`` float64 ``[Hk, D]`` into the fused projection's rows: each query head's rows times its KV
    head's factors, the key rows over them (and the biases alike)."""
    hq, hk, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    row = torch.ones(hq + 2 * hk, d, dtype=torch.float64)  # [q heads | k heads | v heads] x D
    row[:hq] = f.repeat_interleave(hq // hk, dim=0)
    row[hq:hq + hk] = 1.0 / f
    row = row.reshape(-1)
    for p in (attn.qkv_proj.weight, attn.qkv_proj.bias):
        if p is not None:
            p.copy_((p.double() * (row[:, None] if p.dim() == 2 else row)).to(p.dtype))


def _fold_refusal(attn: Any, head_dim: int) -> str | None:
    """Why a layer's attention cannot take key smoothing, or None."""
    from servelab.models.gemma2 import GemmaRMSNorm
    from servelab.models.layers import RMSNorm
    from servelab.models.linear import Linear

    name = type(attn).__name__
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        norms = (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
        if not all(n is not None and type(n) in (GemmaRMSNorm, RMSNorm) and tuple(n.weight.shape) == (head_dim,)
                   for n in norms):
            return (f"{name}'s q_norm / k_norm are not per-head RMSNorms over head_dim={head_dim} (a norm over "
                    "the whole projection mixes heads, and a factor before it is normalized away)")
        return None
    if type(getattr(attn, "qkv_proj", None)) is not Linear or not attn.qkv_proj.weight.is_floating_point():
        return (f"{name} has no per-head q/k norms and its qkv_proj is "
                f"{type(getattr(attn, 'qkv_proj', None)).__name__}, not a dense floating servelab Linear "
                "(quantized weights or adapters would keep unsmoothed key rows)")
    return None


@torch.no_grad()
def fold_key_smoothing(model: Any, factors: torch.Tensor) -> None:
    """Fold key smoothing ``factors`` float ``[num_layers, num_kv_heads, head_dim]`` (positive, equal
    on RoPE pairs: :func:`~servelab.blocks.kv_quant.key_smoothing_factors`) into ``model``'s weights:
    afterwards each layer writes ``K / factors`` and attends with ``q * factors``. Models whose q / k
    norms are per head take one factor vector per layer (equal over KV heads); others take them in the
    fused ``qkv_proj``. ``ValueError`` (nothing changed) for factors of another shape, not positive,
    unequal on a RoPE pair, or a layer that cannot take them (its reason)."""
    cfg = model.config
    layers = model.model.layers
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    if not isinstance(factors, torch.Tensor) or tuple(factors.shape) != shape:
        got = tuple(factors.shape) if isinstance(factors, torch.Tensor) else type(factors).__name__
        raise ValueError(f"factors {got} are invalid; valid: a tensor [num_layers, num_kv_heads, head_dim] = {shape}")
    f = factors.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(f).all()) or not bool((f > 0).all()):
        raise ValueError("factors hold a value that is not finite and > 0")
    half = cfg.head_dim // 2
    if not torch.equal(f[..., :half], f[..., half:]):
        raise ValueError("factors differ between the two channels of a RoPE pair (c and c + head_dim/2); "
                         "only a factor equal on both commutes with the rotation")
    for i, layer in enumerate(layers):
        reason = _fold_refusal(layer.self_attn, cfg.head_dim)
        if reason is not None:
            raise ValueError(f"layer {i}: key smoothing cannot be folded: {reason}")
        if hasattr(layer.self_attn, "q_norm") and not torch.equal(f[i], f[i, :1].expand_as(f[i])):
            raise ValueError(f"layer {i}: factors differ between KV heads, but its q_norm / k_norm are shared by "
                             "every head; give one factor vector per layer")
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        if hasattr(attn, "q_norm"):
            _fold_norms(attn, f[i, 0])
        else:
            _fold_qkv(attn, f[i])
    previous = getattr(model, "kv_key_smoothing", None)
    model.kv_key_smoothing = (f if previous is None else previous.double() * f).float()
    model.reset_attention_state()


def smooth_model_keys(model: Any, prompts: Sequence[Sequence[int]], *, alpha: float = 0.5,
                      max_tokens: int = 2048) -> torch.Tensor:
    """Measure ``model``'s key channels over ``prompts`` (token lists), fold the factors in
    (:func:`fold_key_smoothing`) and return them, float32 ``[num_layers, num_kv_heads, head_dim]``.
    A model with per-head q / k norms gets the maximum over its KV heads (its norms are shared)."""
    amax = measure_key_channel_amax(model, prompts, max_tokens=max_tokens)
    if any(hasattr(layer.self_attn, "q_norm") for layer in model.model.layers):
        amax = amax.amax(dim=1, keepdim=True).expand_as(amax)
    factors = key_smoothing_factors(amax, alpha)
    fold_key_smoothing(model, factors)
    return factors


def calibrate_key_smoothing(pipe: Any, prompts: Sequence[str | Sequence[int]], *, alpha: float = 0.5,
                            max_tokens: int = 2048) -> torch.Tensor:
    """Key smoothing for ``pipe``'s quantized cache, calibrated on ``prompts`` (texts or token lists)
    and folded into its model (:func:`smooth_model_keys`); returns the factors, float32
    ``[num_layers, num_kv_heads, head_dim]``. Refused (``ValueError``, nothing changed) for
    ``kv_cache_dtype="auto"``, a pipeline with unfinished requests, or one already smoothed. The prefix
    cache is reset (its keys were written unsmoothed)."""
    cache = pipe.config.cache
    if cache.kv_cache_dtype == "auto":
        raise ValueError("kv_cache_dtype='auto' stores K unrounded: key smoothing only changes how quantized "
                         "pages round; valid: a quantized kv_cache_dtype")
    if pipe.has_unfinished_requests():
        raise ValueError("calibrate key smoothing before serving: this pipeline has unfinished requests, whose "
                         "pages hold unsmoothed keys")
    if getattr(pipe.model, "kv_key_smoothing", None) is not None:
        raise ValueError("this pipeline's model is already key-smoothed; build a fresh pipeline to calibrate again")
    if not prompts:
        raise ValueError("prompts is empty; give at least one text or token list to calibrate on")
    factors = smooth_model_keys(pipe.model, [_tokens(pipe, p) for p in prompts], alpha=alpha, max_tokens=max_tokens)
    reset = getattr(pipe.kv_cache_manager, "reset_prefix_cache", None)
    if reset is not None:
        reset()
    return factors
