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
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from servelab.blocks.kv_quant import get_kv_cache_dtype
from servelab.models import allocate_kv_caches, prepare_inputs

__all__ = ["calibrate_kv_scales", "load_kv_scales", "save_kv_scales"]


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


@torch.no_grad()
def measure_kv_amax(model: Any, prompts: Sequence[Sequence[int]], *, block_size: int = 16,
                    max_tokens: int = 2048) -> torch.Tensor:
    """float32 ``[num_layers, 2, num_kv_heads]``: the largest ``|K|`` and ``|V|`` each layer writes
    per KV head over ``prompts`` (token lists, each cut to ``max_tokens``), one prompt per forward
    over a fresh cache in the model's dtype."""
    cfg = model.config
    amax = torch.zeros((cfg.num_hidden_layers, 2, cfg.num_key_value_heads), dtype=torch.float32)
    for tokens in prompts:
        tokens = list(tokens)[:max_tokens]
        if not tokens:
            continue
        num_blocks = -(-len(tokens) // block_size) + 1
        caches = allocate_kv_caches(model, num_blocks, block_size)
        table = list(range(1, num_blocks))
        ids, pos, meta = prepare_inputs([tokens], [0], [table], block_size)
        model(ids, pos, caches, meta)
        for layer, (key_cache, value_cache, *_) in enumerate(caches.views):
            for t, cache in enumerate((key_cache, value_cache)):
                written = cache[1:].reshape(-1, *cache.shape[2:])[: len(tokens)]  # [n, Hk, D]
                amax[layer, t] = torch.maximum(amax[layer, t], written.abs().amax(dim=(0, 2)).float())
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
