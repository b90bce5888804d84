"""The grammar-backend seam: compile a constraint once, match it per request.

Two protocols, one registry:

- :class:`GrammarBackend` is built once per (tokenizer, vocabulary size) by a
  registered factory ``factory(tokenizer, vocab_size, stop_token_ids)``; its
  :meth:`~GrammarBackend.compile` turns a :class:`StructuredOutputsParams`
  into a compiled grammar (raising ``ValueError`` with the compiler's message
  when it does not compile) and :meth:`~GrammarBackend.new_matcher` starts a
  per-request state machine on it. Compilation is cached per constraint by
  :class:`~servelab.samplers.structured.manager.StructuredOutputManager`.
- A backend may also offer ``audit(params)``: a
  :class:`~servelab.samplers.structured.schema_audit.SchemaAudit` (or None)
  listing the JSON-schema keywords it will not enforce; the manager calls it
  once per constraint when a request is added, and the pipeline reports the
  list (optional: a backend without it is taken to enforce everything).
- :class:`GrammarMatcher` is that state machine: it fills the request's
  bitmask row for the next token, accepts tokens (``False`` when the grammar
  forbids one, leaving the state unchanged), rolls back, and says when the
  grammar has terminated (the stop token was accepted).

Registry: ``register_grammar_backend(name, factory, *, override=False)``,
``get_grammar_backend(name_or_obj, **factory_kwargs)``,
``available_grammar_backends()``; ``"xgrammar"`` is the default, imported on
first use so that an install without xgrammar only fails when a grammar is
actually requested (``ImportError`` naming the ``structured`` extra).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from servelab._internal.registry import Registry
from servelab.samplers.structured.params import StructuredOutputsParams

__all__ = [
    "GrammarBackend",
    "GrammarMatcher",
    "available_grammar_backends",
    "get_grammar_backend",
    "register_grammar_backend",
]


@runtime_checkable
class GrammarMatcher(Protocol):
    """Per-request grammar state (CPU side)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into int32 ``bitmask[row]`` (``[rows, ceil(V / 32)]``)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; ``False`` (state unchanged) when the grammar forbids it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""


@runtime_checkable
class GrammarBackend(Protocol):
    """Compiles constraints for one tokenizer; see the module docstring."""

    name: str

    def compile(self, params: StructuredOutputsParams) -> Any:
        """A compiled grammar; ``ValueError`` with the compiler's message if it does not compile."""

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""


def _check_backend(obj: Any) -> None:
    if not isinstance(obj, GrammarBackend):
        raise TypeError(f"a grammar backend needs name, compile(params) and new_matcher(compiled); "
                        f"{type(obj).__name__} lacks some")


_BACKENDS: Registry[GrammarBackend] = Registry("grammar backend", factory=True, check=_check_backend)
_BACKENDS.register("xgrammar", "servelab.samplers.structured.xgrammar_backend:XGrammarBackend")


def register_grammar_backend(name: str, factory: Any, *, override: bool = False) -> None:
    """Register ``factory(tokenizer, vocab_size, stop_token_ids) -> GrammarBackend`` under ``name``."""
    _BACKENDS.register(name, factory, override=override)


def get_grammar_backend(name_or_obj: str | GrammarBackend, **factory_kwargs: Any) -> GrammarBackend:
    """A backend by name (built with ``tokenizer=``, ``vocab_size=``, ``stop_token_ids=``) or an object."""
    return _BACKENDS.get(name_or_obj, **factory_kwargs)


def available_grammar_backends() -> list[str]:
    return _BACKENDS.available()
