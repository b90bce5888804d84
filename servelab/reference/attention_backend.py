"""The ``"torch"`` attention backend: the references behind the backend interface.

Registered lazily by :mod:`servelab.attention.backends` as
``"servelab.reference.attention_backend:TorchAttentionBackend"``, so that no
fast-path module imports :mod:`servelab.reference`. Any device torch runs on,
float64 included, any head size and block size, every feature (softcap and
the log-sum-exp too). Slow by design: it loops over sequences.
"""

from __future__ import annotations

import torch

from servelab.attention.backends import ALL_DTYPES, ALL_FEATURES, ANY_DEVICE, AttentionBackend, AttentionCapabilities
from servelab.reference.merge_attn_states import merge_attn_states
from servelab.reference.paged_attention import paged_attention
from servelab.reference.reshape_and_cache import reshape_and_cache

__all__ = ["TorchAttentionBackend"]


class TorchAttentionBackend(AttentionBackend):
    """The PyTorch references: any device torch runs on, float64 included, any head size."""

    name = "torch"
    capabilities = AttentionCapabilities(dtypes=ALL_DTYPES, device_types=ANY_DEVICE, features=ALL_FEATURES,
                                         supported_kv_cache_dtypes=("auto", "any"))

    def _paged_attention(self, *args, **kwargs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return paged_attention(*args, **kwargs)

    def _reshape_and_cache(self, *args, **kwargs) -> None:
        return reshape_and_cache(*args, **kwargs)

    def _merge_attn_states(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return merge_attn_states(*args, **kwargs)
