"""Drafters for speculative decoding, all in one place.

- :mod:`~servelab.samplers.drafters.base`: the :class:`Drafter` ABC (batch API
  ``propose_for_requests`` + ``release``), :class:`DraftProposal`,
  :class:`DraftRequest`, and the registry (``register_drafter`` /
  ``get_drafter`` / ``available_drafters``).
- :mod:`~servelab.samplers.drafters.ngram`: :class:`NgramDrafter` (``"ngram"``).
- :mod:`~servelab.samplers.drafters.draft_model`: :class:`DraftModelDrafter`
  (``"draft_model"``, or a checkpoint folder path).

- :mod:`~servelab.samplers.drafters.ngram_tree`: :class:`NgramTreeDrafter` (``"ngram_tree"``).
- :mod:`~servelab.samplers.drafters.layer_skip`: :class:`LayerSkipDrafter`
  (``"layer_skip"``: the target's own first layers draft).

A proposal is a chain, or a token tree (:class:`DraftTree`,
``DraftProposal.from_tree``) that the runner verifies in one step.
"""

from servelab.samplers.drafters.base import (
    DraftProposal,
    DraftRequest,
    Drafter,
    DraftTree,
    available_drafters,
    check_drafter,
    check_proposals,
    get_drafter,
    register_drafter,
)
from servelab.samplers.drafters.draft_model import (
    DraftModelDrafter,
    flat_step_inputs,
    load_draft_model_drafter,
    resolve_drafter,
)
from servelab.samplers.drafters.layer_skip import LayerSkipDrafter, early_exit_view
from servelab.samplers.drafters.ngram import NgramDrafter
from servelab.samplers.drafters.ngram_tree import NgramTreeDrafter

__all__ = [
    "DraftModelDrafter",
    "DraftProposal",
    "DraftRequest",
    "DraftTree",
    "Drafter",
    "LayerSkipDrafter",
    "NgramDrafter",
    "NgramTreeDrafter",
    "available_drafters",
    "check_drafter",
    "check_proposals",
    "early_exit_view",
    "flat_step_inputs",
    "get_drafter",
    "load_draft_model_drafter",
    "register_drafter",
    "resolve_drafter",
]
