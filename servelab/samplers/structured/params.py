"""``StructuredOutputsParams``: the grammar a request's output must follow."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StructuredOutputsParams", "require_jsonschema"]


def require_jsonschema() -> Any:
    """The ``jsonschema`` module; ``ImportError`` naming the ``structured`` extra when missing."""
    try:
        import jsonschema
    except ImportError as exc:
        raise ImportError('StructuredOutputsParams(validate=True) needs jsonschema: pip install '
                          f'"servelab[structured]" (or pip install jsonschema); import failed: {exc}') from exc
    return jsonschema

_KINDS = ("json", "regex", "grammar", "choice")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint, under the names users know from vLLM.

    Attributes:
        json: a JSON schema, as a dict or a JSON string; the output is one JSON
            value valid under it.
        regex: a regular expression the whole output matches.
        grammar: an EBNF (GBNF-style) grammar with a ``root`` rule.
        choice: a list of strings; the output is exactly one of them.
        strict: ``json=`` only. True (default): compiled in strict mode — no
            properties or array items beyond those the schema lists, as if
            ``additionalProperties``/``items`` were false where absent. Outputs
            stay valid under the schema (strict mode only narrows it) and short;
            the pre-pass adds ``items: {}`` where strict mode would refuse the
            schema (``minItems`` without ``items``). False: JSON Schema's own
            defaults (unlisted properties allowed, with any value).
        validate: ``json=`` only. True: each output that finishes with ``"stop"``
            is parsed strictly (``json.loads``) and validated against the
            schema as given (``jsonschema``, the ``structured`` extra);
            violations are listed in ``GenerationOutput.structured_violations``
            (an empty list when it validates). The grammar makes most
            violations impossible; the schema pre-pass lists what it cannot
            enforce (``GenerationOutput.structured_unenforced``), and this
            check says whether an output actually hit one.

    Only the shape is checked here (one field set, the right types, a
    parseable JSON string); whether a grammar *compiles* is decided by the
    grammar backend when the request is added, and a grammar that does not
    compile fails that request alone with the compiler's message.
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None
    strict: bool = True
    validate: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of json, regex, grammar, choice; "
                             f"got {', '.join(given) or 'none'}")
        kind = given[0]
        for flag in ("strict", "validate"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"StructuredOutputsParams.{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.validate:
            if kind != "json":
                raise ValueError(f"StructuredOutputsParams.validate=True needs json=, got {kind}=")
            require_jsonschema()
        value = getattr(self, kind)
        if kind == "json":
            self._check_json(value)
        elif kind == "choice":
            if isinstance(value, str) or not isinstance(value, Sequence) or not value or \
                    not all(isinstance(c, str) and c for c in value):
                raise ValueError(f"choice={value!r} must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(value))
        elif not isinstance(value, str) or not value.strip():
            raise ValueError(f"{kind}={value!r} must be a non-empty string")

    @staticmethod
    def _check_json(value: Any) -> None:
        if isinstance(value, str):
            try:
                json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json={value[:60]!r} is not valid JSON: {exc}") from None
        elif isinstance(value, Mapping):
            try:
                json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"json schema is not JSON-serialisable: {exc}") from None
        else:
            raise TypeError(f"json must be a schema dict or a JSON string, got {type(value).__name__}")

    @property
    def schema(self) -> Any:
        """The ``json=`` schema as a Python object (None for the other kinds)."""
        if self.json is None:
            return None
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    @property
    def kind(self) -> str:
        """Which constraint is set: ``"json"``, ``"regex"``, ``"grammar"`` or ``"choice"``."""
        return next(k for k in _KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """A hashable identity of the constraint (compilation cache key)."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            value = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            return (kind if self.strict else "json-lax"), value
        if kind == "choice":
            value = json.dumps(list(value))
        return kind, value
