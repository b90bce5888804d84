"""``StructuredOutputsParams``: the grammar a request's output must follow."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StructuredOutputsParams"]

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

    Only the shape is checked here (one field set, the right types, a
    parseable JSON string); whether a grammar *compiles* is decided by the
    grammar backend when the request is added, and a grammar that does not
    compile fails that request alone with the compiler's message.
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of json, regex, grammar, choice; "
                             f"got {', '.join(given) or 'none'}")
        kind = given[0]
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
    def kind(self) -> str:
        """Which constraint is set: ``"json"``, ``"regex"``, ``"grammar"`` or ``"choice"``."""
        return next(k for k in _KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """A hashable identity of the constraint (compilation cache key)."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            value = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(list(value))
        return kind, value
