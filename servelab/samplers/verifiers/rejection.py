"""Public rejection sampler: validation plus backend choice.

Contract in :mod:`servelab.reference.rejection_sample`; the Triton twin is
:mod:`servelab.kernels.rejection_sample`. Both draw their noise identically,
so for the same generator state they return the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelab.samplers.backends import op_module


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: bool | torch.Tensor = False,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
    backend: str = "auto",
    check_inputs: bool = True,
) -> torch.Tensor:
    """Verify ragged drafts; returns int64 ``[num_reqs, max(k_i) + 1]``, ``-1`` padded.

    Args:
        draft_token_ids: int ``[sum(k_i)]``; request *i* owns ``k_i`` consecutive entries.
        num_draft_tokens: ``k_i`` per request (list or 1-D int tensor; 0 allowed).
        target_probs: float ``[sum(k_i + 1), vocab]``: per request, one row per draft
            position then the bonus row (after temperature, top-k/p...:
            :meth:`Sampler.compute_probs`).
        draft_probs: float ``[sum(k_i), vocab]``, or None for one-hot (n-gram) drafts.
        greedy: a bool, or bool ``[num_reqs]``.
        generator: None, one ``torch.Generator``, or one (or None) per request.
        backend: ``"auto"`` (Triton for CUDA tensors), ``"torch"`` or ``"triton"``.
        check_inputs: validate shapes, dtypes and draft ids (False skips the device sync).

    Each output row holds the accepted drafts, then the recovered (first
    rejection) or bonus (all accepted) token; every emitted token is
    distributed exactly as the target in random mode.
    """
    device = target_probs.device if isinstance(target_probs, torch.Tensor) else torch.device("cpu")
    module = op_module("rejection_sample", backend, device)
    return module.rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        target_probs,
        draft_probs,
        greedy=greedy,
        generator=generator,
        check_inputs=check_inputs,
    )
