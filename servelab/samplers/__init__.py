"""Samplers: ``SamplingParams``, ``SamplingMetadata``, the ``Sampler`` with its
ordered logits-processing steps, and speculative decoding: verifiers
(rejection sampling, typical acceptance, token trees) and drafters.

The contracts (``Sampler`` and ``Verifier`` protocols, the ``Drafter`` ABC,
``LogitsProcessor``, ``SamplerOutput``) are in :mod:`servelab.samplers.interfaces`.
Here ``Sampler`` is the built-in implementation; the protocol is exported as
``SamplerProtocol``. Registries: :func:`get_verifier`, :func:`get_drafter`,
:func:`get_sampling_backend` (each with ``register_*`` / ``available_*``).

Imports without Triton: the kernels load lazily when a ``"triton"`` backend
is chosen (see :mod:`servelab.samplers.backends`).
"""

from servelab.samplers.backends import (
    available_sampling_backends,
    get_sampling_backend,
    register_sampling_backend,
    resolve_backend,
    triton_unavailable_reason,
)
from servelab.samplers.drafters import (
    DraftModelDrafter,
    DraftProposal,
    DraftRequest,
    Drafter,
    NgramDrafter,
    available_drafters,
    get_drafter,
    register_drafter,
)
from servelab.samplers.interfaces import LogprobsOutput, SamplerOutput, Verifier
from servelab.samplers.interfaces import SamplerProtocol
from servelab.samplers.metadata import SamplingMetadata
from servelab.samplers.params import SAMPLING_EPS, SamplingParams
from servelab.samplers.processors import LogitBiasProcessor, LogitsProcessor, MinTokensProcessor
from servelab.samplers.sampler import Sampler
from servelab.samplers.verifiers import (
    AcceptanceStats,
    RejectionVerifier,
    TokenTree,
    TreeVerifier,
    TreeVerifyOutput,
    TypicalAcceptanceVerifier,
    available_verifiers,
    get_verifier,
    num_accepted_tokens,
    register_verifier,
    rejection_sample,
    tree_attention_mask,
    typical_acceptance_sample,
    verify_tree_greedy,
    verify_tree_stochastic,
)

__all__ = [
    "SAMPLING_EPS",
    "AcceptanceStats",
    "DraftModelDrafter",
    "DraftProposal",
    "DraftRequest",
    "Drafter",
    "LogitBiasProcessor",
    "LogitsProcessor",
    "LogprobsOutput",
    "MinTokensProcessor",
    "NgramDrafter",
    "RejectionVerifier",
    "Sampler",
    "SamplerOutput",
    "SamplerProtocol",
    "SamplingMetadata",
    "SamplingParams",
    "TokenTree",
    "TreeVerifier",
    "TreeVerifyOutput",
    "TypicalAcceptanceVerifier",
    "Verifier",
    "available_drafters",
    "available_sampling_backends",
    "available_verifiers",
    "get_drafter",
    "get_sampling_backend",
    "get_verifier",
    "num_accepted_tokens",
    "register_drafter",
    "register_sampling_backend",
    "register_verifier",
    "rejection_sample",
    "resolve_backend",
    "tree_attention_mask",
    "triton_unavailable_reason",
    "typical_acceptance_sample",
    "verify_tree_greedy",
    "verify_tree_stochastic",
]
