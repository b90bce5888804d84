"""Validate a finished output against its JSON schema (``StructuredOutputsParams(validate=True)``).

The pipeline calls :func:`schema_violations` once per request that finishes
with ``"stop"`` and asked for it; the result goes to
``GenerationOutput.structured_violations``. ``jsonschema`` is an optional
dependency (the ``structured`` extra), imported on first use.
"""

from __future__ import annotations

import json
from typing import Any

from servelab.samplers.structured.exact_numbers import NumberLiteral, compare, is_multiple, show, to_exact
from servelab.samplers.structured.params import StructuredOutputsParams, require_jsonschema

__all__ = ["parse_strict_json", "schema_violations"]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_strict_json(text: str) -> Any:
    """``json.loads`` as strict as RFC 8259: no raw control characters in strings, no NaN/Infinity.

    Non-integer numbers come back as :class:`~.exact_numbers.NumberLiteral` (a ``float`` that keeps
    its text), so numeric keywords can be judged on the number as written."""
    return json.loads(text, strict=True, parse_constant=_refuse_constant, parse_float=NumberLiteral)


def _bound(keyword: str, lower: bool, bound: Any, instance: Any, strict: bool):
    from jsonschema import ValidationError

    x, b = to_exact(instance), to_exact(bound)
    if x is None or b is None:  # not a finite number (inf from a huge literal is handled exactly by the text)
        return
    order = compare(x, b)
    failed = (order < 0 or (strict and order == 0)) if lower else (order > 0 or (strict and order == 0))
    if failed:
        side = "less" if lower else "greater"
        yield ValidationError(f"{show(instance)} is {side} than {'or equal to ' if strict else ''}the "
                              f"{'minimum' if lower else 'maximum'} of {show(bound)}")


def _exact_keywords() -> dict[str, Any]:
    """jsonschema keyword functions judging numbers exactly (both the draft-4 boolean and the draft-6+
    numeric forms of ``exclusiveMinimum`` / ``exclusiveMaximum``)."""
    from jsonschema import ValidationError

    def multiple_of(validator, divisor, instance, schema):
        x, d = to_exact(instance), to_exact(divisor)
        if x is None or d is None or d.mantissa <= 0 or not validator.is_type(instance, "number"):
            return
        if not is_multiple(x, d):
            yield ValidationError(f"{show(instance)} is not a multiple of {show(divisor)}")

    def minimum(validator, bound, instance, schema):
        if validator.is_type(instance, "number"):
            yield from _bound("minimum", True, bound, instance, schema.get("exclusiveMinimum") is True)

    def maximum(validator, bound, instance, schema):
        if validator.is_type(instance, "number"):
            yield from _bound("maximum", False, bound, instance, schema.get("exclusiveMaximum") is True)

    def exclusive_minimum(validator, bound, instance, schema):
        if not isinstance(bound, bool) and validator.is_type(instance, "number"):
            yield from _bound("exclusiveMinimum", True, bound, instance, True)

    def exclusive_maximum(validator, bound, instance, schema):
        if not isinstance(bound, bool) and validator.is_type(instance, "number"):
            yield from _bound("exclusiveMaximum", False, bound, instance, True)

    return {"multipleOf": multiple_of, "minimum": minimum, "maximum": maximum,
            "exclusiveMinimum": exclusive_minimum, "exclusiveMaximum": exclusive_maximum}


def schema_violations(params: StructuredOutputsParams, text: str) -> list[str]:
    """Why ``text`` is not a valid instance of ``params``' schema; ``[]`` when it is.

    Each entry is ``"keyword at /json/pointer: message"`` (``"json: ..."`` when
    the text does not even parse strictly). The validator class follows the
    schema's ``$schema`` (the newest draft when it has none); ``format`` is
    not asserted (JSON Schema's default). ``multipleOf``, ``minimum``,
    ``maximum`` and the exclusive bounds are judged on the numbers as written,
    exactly (:mod:`.exact_numbers`): a literal that a float reads as 0.0 or
    inf never hides a violation.
    """
    jsonschema = require_jsonschema()
    try:
        value = parse_strict_json(text)
    except (ValueError, RecursionError) as exc:
        return [f"json: not strict JSON: {exc}"]
    schema = params.schema
    try:
        base = jsonschema.validators.validator_for(schema)
        validator = jsonschema.validators.extend(base, _exact_keywords())(schema)
        errors = list(validator.iter_errors(value))
    except Exception as exc:  # a schema the validator cannot use (bad $ref, invalid schema)
        return [f"schema: could not validate against it: {type(exc).__name__}: {str(exc).splitlines()[0]}"]
    return [f"{e.validator} at /{'/'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in errors]
