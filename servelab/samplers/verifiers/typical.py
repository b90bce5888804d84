"""Typical acceptance (Medusa): accept drafts the target finds plausible enough.

The implementation is the PyTorch reference
(:func:`servelab.reference.typical_acceptance.typical_acceptance_sample`):
the work per step is a handful of gathers and one entropy per draft row, which
PyTorch already runs at memory speed, so there is no separate kernel.
"""

from servelab.reference.typical_acceptance import typical_acceptance_sample

__all__ = ["typical_acceptance_sample"]
