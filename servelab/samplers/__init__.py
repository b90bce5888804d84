"""Samplers: ``SamplingParams``, ``SamplingMetadata``, the ``Sampler`` with its
ordered logits-processing steps, and the speculative-decoding verifiers
(rejection sampling, typical acceptance, token trees) with their drafters.

Imports without Triton: the kernels load lazily when a ``"triton"`` backend
is chosen (see :mod:`servelab.samplers.backends`).
"""

from servelab.samplers.backends import resolve_backend, triton_unavailable_reason
from servelab.samplers.drafters import DraftProposal, Drafter, NgramDrafter
from servelab.samplers.metadata import SamplingMetadata
from servelab.samplers.params import SAMPLING_EPS, SamplingParams
from servelab.samplers.processors import LogitBiasProcessor, LogitsProcessor, MinTokensProcessor
from servelab.samplers.sampler import LogprobsOutput, Sampler, SamplerOutput
from servelab.samplers.verifiers import (
    AcceptanceStats,
    TokenTree,
    TreeVerifyOutput,
    num_accepted_tokens,
    rejection_sample,
    tree_attention_mask,
    typical_acceptance_sample,
    verify_tree_greedy,
    verify_tree_stochastic,
)

__all__ = [
    "SAMPLING_EPS",
    "AcceptanceStats",
    "DraftProposal",
    "Drafter",
    "LogitBiasProcessor",
    "LogitsProcessor",
    "LogprobsOutput",
    "MinTokensProcessor",
    "NgramDrafter",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "TokenTree",
    "TreeVerifyOutput",
    "num_accepted_tokens",
    "rejection_sample",
    "resolve_backend",
    "tree_attention_mask",
    "triton_unavailable_reason",
    "typical_acceptance_sample",
    "verify_tree_greedy",
    "verify_tree_stochastic",
]
