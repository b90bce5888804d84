"""Rejection sampling (exact): the public op with backend choice, and the ``"rejection"`` verifier.

Contract in :mod:`servelab.reference.rejection_sample`; the Triton twin is
:mod:`servelab.kernels.rejection_sample`. Both draw their noise identically,
so for the same generator state they return the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelab.samplers.backends import check_backend_name, get_sampling_backend
from servelab.samplers.verifiers.tree import TreeVerifier, TreeVerifyOutput

__all__ = ["RejectionVerifier", "rejection_sample"]


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: bool | torch.Tensor = False,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
    backend: str | object = "auto",
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
        backend: ``"auto"`` (Triton for CUDA tensors), a registered sampling
            backend name (``"torch"``, ``"triton"``) or a backend object.
        check_inputs: validate shapes, dtypes, draft ids and probabilities
            (NaN, negative or all-zero rows raise ``ValueError`` naming the
            argument); False skips these device syncs.

    Each output row holds the accepted drafts, then the recovered (first
    rejection) or bonus (all accepted) token; every emitted token is
    distributed exactly as the target in random mode.
    """
    device = target_probs.device if isinstance(target_probs, torch.Tensor) else torch.device("cpu")
    return get_sampling_backend(backend, device).rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        target_probs,
        draft_probs,
        greedy=greedy,
        generator=generator,
        check_inputs=check_inputs,
    )


class RejectionVerifier:
    """The ``"rejection"`` verifier (default): :func:`rejection_sample` behind the Verifier protocol.

    Args:
        backend: sampling backend for the op (``"auto"``, ``"torch"``, ``"triton"`` or an object).
        check_inputs: validate every call (a device sync; keep it on unless profiling).
    """

    name = "rejection"

    def __init__(self, backend: str | object = "auto", *, check_inputs: bool = True) -> None:
        self.backend = check_backend_name(backend)
        self.check_inputs = bool(check_inputs)

    def __repr__(self) -> str:
        return f"RejectionVerifier(backend={self.backend!r})"

    def verify(
        self,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: Sequence[int],
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor | None,
        *,
        greedy: torch.Tensor,
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """See :class:`servelab.samplers.interfaces.Verifier`."""
        return rejection_sample(
            draft_token_ids, num_draft_tokens, target_probs, draft_probs,
            greedy=greedy, generator=list(generators), backend=self.backend, check_inputs=self.check_inputs,
        )

    def verify_trees(self, draft_token_ids: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None = None, *, greedy: torch.Tensor | bool = False,
                     generators: Sequence[torch.Generator | None] | None = None) -> TreeVerifyOutput:
        """Token trees: multi-candidate rejection sampling (SpecInfer), which on a one-branch
        tree is exactly this verifier's rule; see :meth:`TreeVerifier.verify_trees`."""
        return TreeVerifier(check_inputs=self.check_inputs).verify_trees(
            draft_token_ids, parents, target_probs, draft_probs, greedy=greedy, generators=generators)
