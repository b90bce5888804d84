"""Speculative-decoding verifiers: rejection sampling, typical acceptance, token trees."""

from servelab.samplers.verifiers.metrics import AcceptanceStats, num_accepted_tokens
from servelab.samplers.verifiers.rejection import rejection_sample
from servelab.samplers.verifiers.tree import (
    TokenTree,
    TreeVerifyOutput,
    tree_attention_mask,
    verify_tree_greedy,
    verify_tree_stochastic,
)
from servelab.samplers.verifiers.typical import typical_acceptance_sample

__all__ = [
    "AcceptanceStats",
    "TokenTree",
    "TreeVerifyOutput",
    "num_accepted_tokens",
    "rejection_sample",
    "tree_attention_mask",
    "typical_acceptance_sample",
    "verify_tree_greedy",
    "verify_tree_stochastic",
]
