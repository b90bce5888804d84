"""The default grammar backend: xgrammar (CPU, C++ matcher, packed int32 bitmasks).

JSON schemas go through the pre-pass first
(:func:`~servelab.samplers.structured.schema_audit.audit_json_schema`): the
backend compiles the audited schema, and :meth:`XGrammarBackend.audit` tells
the pipeline which keywords stay unenforced. The converted grammar then gets
one more fix: strings with ``minLength``/``maxLength`` are compiled to a
character class that admits raw control characters (U+0000-U+001F), which
strict JSON parsers refuse; :func:`exclude_control_characters` removes them
from that class (the grammar's text round-trips exactly through xgrammar's
EBNF parser). And :func:`bound_exponent_digits` gives a number's exponent at
most :data:`MAX_EXPONENT_DIGITS` digits: the converter admits any number of
them, so a model could write ``41111e-1210092402452222222222``, which a float
reads as 0.0 (validation judges it exactly anyway,
:mod:`.exact_numbers`); three digits still reach past float range (``1e308``).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from servelab.samplers.structured.params import StructuredOutputsParams
from servelab.samplers.structured.schema_audit import SchemaAudit, audit_json_schema

try:
    import xgrammar as xgr
except ImportError as exc:  # pragma: no cover - exercised by the missing-extra test via sys.modules
    raise ImportError('structured outputs need xgrammar: pip install "servelab[structured]" '
                      f"(or pip install xgrammar); import failed: {exc}") from exc

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# The bounded-string character class of xgrammar's JSON-schema converter, as its EBNF prints it, and the
# same class without control characters (the one its unbounded strings use).
_BOUNDED_CHARS = '[^\\"\\\\\\r\\n]'
_BOUNDED_CHARS_FIXED = '[^\\0-\\x1f\\"\\\\\\r\\n]'
MAX_EXPONENT_DIGITS = 3
# The exponent of xgrammar's JSON number rule as its EBNF prints it: [eE], the sign rule, digits{1, -1}.
_EXPONENT = re.compile(r"(\[eE\] \w+ \w+)\{1, -1\}")


def exclude_control_characters(ebnf: str) -> str:
    """The grammar text with raw control characters taken out of bounded strings' character class."""
    return ebnf.replace(_BOUNDED_CHARS, _BOUNDED_CHARS_FIXED)


def bound_exponent_digits(ebnf: str) -> str:
    """The grammar text with every number's exponent limited to :data:`MAX_EXPONENT_DIGITS` digits."""
    return _EXPONENT.sub(rf"\1{{1, {MAX_EXPONENT_DIGITS}}}", ebnf)


def json_schema_grammar(params: StructuredOutputsParams) -> Any:
    """The ``xgrammar.Grammar`` compiled for a ``json=`` constraint: the audited schema, converted
    (no free whitespace; strict mode per ``params.strict``), control characters out of bounded strings."""
    schema = audit_json_schema(params.schema, strict=params.strict).schema
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=params.strict)
    text = str(grammar)
    patched = bound_exponent_digits(exclude_control_characters(text))
    if patched == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(patched)
    except (RuntimeError, ValueError) as exc:  # the printed grammar did not parse back: keep the converter's
        warnings.warn(f"structured outputs: bounded strings of this schema may admit raw control characters and "
                      f"numbers an exponent of any length "
                      f"(the grammar fix did not apply: {str(exc).splitlines()[0] if str(exc) else exc!r})",
                      RuntimeWarning, stacklevel=2)
        return grammar


class XGrammarMatcher:
    """A :class:`~servelab.samplers.structured.backend.GrammarMatcher` over ``xgrammar.GrammarMatcher``."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarBackend:
    """Compiles JSON schemas, regexes, EBNF grammars and choice lists with xgrammar.

    Args:
        tokenizer: a Hugging Face tokenizer (its vocabulary is decoded once).
        vocab_size: the model's vocabulary (may exceed the tokenizer's; the
            extra ids are never allowed).
        stop_token_ids: the ids that end a request (the model's EOS ids); once
            the grammar is complete only these are allowed.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()) -> None:
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; the pipeline has none")
        stops = list(stop_token_ids) or None
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1)

    def compile(self, params: StructuredOutputsParams) -> Any:
        kind, value = params.kind, getattr(params, params.kind)
        try:
            if kind == "json":
                return self._compiler.compile_grammar(json_schema_grammar(params))
            if kind == "regex":
                return self._compiler.compile_regex(value)
            if kind == "grammar":
                return self._compiler.compile_grammar(value)
            alternatives = " | ".join(json.dumps(c) for c in value)  # EBNF string literals
            return self._compiler.compile_grammar(f"root ::= {alternatives}")
        except (RuntimeError, ValueError) as exc:
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            message = _LOG_PREFIX.sub("", lines[0])  # drop xgrammar's "[time] file.cc:line: "
            raise ValueError(f"structured_outputs {kind}= does not compile: {message}") from None

    def audit(self, params: StructuredOutputsParams) -> SchemaAudit | None:
        """The schema pre-pass for a ``json=`` constraint (None for the other kinds)."""
        if params.kind != "json":
            return None
        return audit_json_schema(params.schema, strict=params.strict)

    def new_matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))  # rollback depth is unlimited
