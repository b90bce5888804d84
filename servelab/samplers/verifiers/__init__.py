"""Speculative-decoding verifiers: one protocol, a registry, three implementations.

- :class:`RejectionVerifier` (``"rejection"``, default) over :func:`rejection_sample`
  (exact; Triton kernel or PyTorch reference).
- :class:`TypicalAcceptanceVerifier` (``"typical"``) over :func:`typical_acceptance_sample`
  (Medusa; more acceptance, not exact).
- :class:`TreeVerifier` (``"tree"``) over :func:`verify_tree_greedy` /
  :func:`verify_tree_stochastic` (SpecInfer), plus :class:`TokenTree` and
  :func:`tree_attention_mask`. Chains are one-branch trees.

Choose one with :func:`get_verifier` (a name or any object implementing
:class:`~servelab.samplers.interfaces.Verifier`); add one with
:func:`register_verifier`. The plain references live in
:mod:`servelab.reference` and are not imported here.
"""

from servelab.samplers.verifiers.metrics import AcceptanceStats, num_accepted_tokens
from servelab.samplers.verifiers.registry import (
    DEFAULT_VERIFIER,
    available_verifiers,
    check_verifier,
    check_verifier_output,
    get_verifier,
    register_verifier,
)
from servelab.samplers.verifiers.rejection import RejectionVerifier, rejection_sample
from servelab.samplers.verifiers.tree import (
    TokenTree,
    TreeVerifier,
    TreeVerifyOutput,
    tree_attention_mask,
    verify_tree_greedy,
    verify_tree_stochastic,
)
from servelab.samplers.verifiers.typical import TypicalAcceptanceVerifier, typical_acceptance_sample

__all__ = [
    "DEFAULT_VERIFIER",
    "AcceptanceStats",
    "RejectionVerifier",
    "TokenTree",
    "TreeVerifier",
    "TreeVerifyOutput",
    "TypicalAcceptanceVerifier",
    "available_verifiers",
    "check_verifier",
    "check_verifier_output",
    "get_verifier",
    "num_accepted_tokens",
    "register_verifier",
    "rejection_sample",
    "tree_attention_mask",
    "typical_acceptance_sample",
    "verify_tree_greedy",
    "verify_tree_stochastic",
]
