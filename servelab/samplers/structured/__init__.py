"""Structured outputs: grammar-constrained decoding as a swappable sampler piece.

- :class:`StructuredOutputsParams` (``json=``, ``regex=``, ``grammar=``,
  ``choice=``: exactly one) travels in ``SamplingParams.structured_outputs``.
- :mod:`~servelab.samplers.structured.backend`: the grammar-backend seam
  (:class:`GrammarBackend`, :class:`GrammarMatcher`, a registry with
  ``"xgrammar"`` as the default).
- :class:`StructuredOutputManager`: compilation cache, per-request matchers,
  one bitmask row per sampled position (drafts included), accept / rollback.
- :func:`apply_token_bitmask`: packed int32 bitmasks applied to
  ``[num_tokens, vocab]`` logits (Triton kernel :mod:`servelab.kernels.bitmask`,
  reference :mod:`servelab.reference.bitmask`, a vectorised CPU path).

xgrammar is imported only when a grammar is actually requested; without it
that request fails with an ``ImportError`` naming the ``structured`` extra.
"""

from servelab.samplers.structured.backend import (
    GrammarBackend,
    GrammarMatcher,
    available_grammar_backends,
    get_grammar_backend,
    register_grammar_backend,
)
from servelab.samplers.structured.bitmask import apply_token_bitmask, bitmask_allows_nothing, unpack_bitmask
from servelab.samplers.structured.manager import StructuredOutputManager
from servelab.samplers.structured.params import StructuredOutputsParams

__all__ = [
    "GrammarBackend",
    "GrammarMatcher",
    "StructuredOutputManager",
    "StructuredOutputsParams",
    "apply_token_bitmask",
    "available_grammar_backends",
    "bitmask_allows_nothing",
    "get_grammar_backend",
    "register_grammar_backend",
    "unpack_bitmask",
]
