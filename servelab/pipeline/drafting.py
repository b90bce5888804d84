"""Moved to :mod:`servelab.samplers.drafters` (this re-export goes once nothing imports it)."""

from servelab.samplers.drafters import DraftModelDrafter, DraftRequest, flat_step_inputs, resolve_drafter  # noqa: F401
