"""Validate a finished output against its JSON schema (``StructuredOutputsParams(validate=True)``).

The pipeline calls :func:`schema_violations` once per request that finishes
with ``"stop"`` and asked for it; the result goes to
``GenerationOutput.structured_violations``. ``jsonschema`` is an optional
dependency (the ``structured`` extra), imported on first use.
"""

from __future__ import annotations

import json
from typing import Any

from servelab.samplers.structured.params import StructuredOutputsParams, require_jsonschema

__all__ = ["parse_strict_json", "schema_violations"]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_strict_json(text: str) -> Any:
    """``json.loads`` as strict as RFC 8259: no raw control characters in strings, no NaN/Infinity."""
    return json.loads(text, strict=True, parse_constant=_refuse_constant)


def schema_violations(params: StructuredOutputsParams, text: str) -> list[str]:
    """Why ``text`` is not a valid instance of ``params``' schema; ``[]`` when it is.

    Each entry is ``"keyword at /json/pointer: message"`` (``"json: ..."`` when
    the text does not even parse strictly). The validator class follows the
    schema's ``$schema`` (the newest draft when it has none); ``format`` is
    not asserted (JSON Schema's default).
    """
    jsonschema = require_jsonschema()
    try:
        value = parse_strict_json(text)
    except (ValueError, RecursionError) as exc:
        return [f"json: not strict JSON: {exc}"]
    schema = params.schema
    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        errors = list(validator.iter_errors(value))
    except Exception as exc:  # a schema the validator cannot use (bad $ref, invalid schema)
        return [f"schema: could not validate against it: {type(exc).__name__}: {str(exc).splitlines()[0]}"]
    return [f"{e.validator} at /{'/'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in errors]
