"""validate=True judges numeric keywords on the number as written: exactly, for exponents of any size."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.samplers.structured.exact_numbers import compare, is_multiple, parse_literal

pytest.importorskip("jsonschema")

literals = st.builds(
    lambda sign, whole, frac, exp: f"{sign}{whole}{'.' + frac if frac else ''}{'e' + str(exp) if exp is not None else ''}",
    st.sampled_from(["", "-"]), st.integers(0, 10 ** 6).map(str),
    st.one_of(st.just(""), st.text("0123456789", min_size=1, max_size=6)),
    st.one_of(st.none(), st.integers(-40, 40)))


def exact(text: str) -> Fraction:
    """The reference: Python's Fraction reads a decimal literal exactly."""
    return Fraction(text)


@settings(max_examples=300, deadline=None)
@given(literals, literals)
def test_compare_matches_fractions(a, b):
    fa, fb = exact(a), exact(b)
    assert compare(parse_literal(a), parse_literal(b)) == (fa > fb) - (fa < fb)


@settings(max_examples=300, deadline=None)
@given(literals, literals)
def test_is_multiple_matches_fractions(x, d):
    fd = exact(d)
    if fd == 0:
        return
    assert is_multiple(parse_literal(x), parse_literal(d)) == ((exact(x) / abs(fd)).denominator == 1)


@pytest.mark.parametrize(("x", "d", "expected"), [
    ("41111e-1210092402452222222222", "0.01", False),  # a float reads it as 0.0, a multiple of anything
    ("1e1210092402452222222222", "0.01", True),
    ("3e1210092402452222222222", "7", False),
    ("0e-99999999999999999999", "0.01", True),
    ("25e-1", "0.5", True),
    ("1e-2", "0.01", True),
])
def test_is_multiple_far_beyond_float_range(x, d, expected):
    assert is_multiple(parse_literal(x), parse_literal(d)) is expected


@pytest.mark.parametrize(("a", "b", "expected"), [
    ("1e-1210092402452222222222", "0", 1), ("-1e-1210092402452222222222", "0", -1),
    ("1e400", "1e399", 1), ("-1e400", "-1e399", -1), ("10e399", "1e400", 0),
    ("123456789e-1000000000000000000000", "123456788e-1000000000000000000000", 1),
])
def test_compare_far_beyond_float_range(a, b, expected):
    assert compare(parse_literal(a), parse_literal(b)) == expected


def _violations(schema, text):
    from servelab.samplers.structured import StructuredOutputsParams
    from servelab.samplers.structured.validation import schema_violations

    return schema_violations(StructuredOutputsParams(json=schema, validate=True), text)


def test_the_underflowing_amount_of_the_issue_is_a_violation():
    schema = {"type": "object", "properties": {"total": {"type": "object", "properties": {
        "income": {"type": "number", "multipleOf": 0.01}}}}}
    text = '{"total": {"income": 41111e-1210092402452222222222}}'
    assert [v.split(":")[0] for v in _violations(schema, text)] == ["multipleOf at /total/income"]
    assert _violations(schema, '{"total": {"income": 411.11}}') == []
    assert _violations(schema, '{"total": {"income": 0.1e1}}') == []


@pytest.mark.parametrize(("schema", "text", "keyword"), [
    ({"type": "number", "minimum": 0}, "-1e-999", "minimum"),
    ({"type": "number", "maximum": 1e308}, "1e309", "maximum"),
    ({"type": "number", "exclusiveMinimum": 0}, "0e5", "exclusiveMinimum"),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 0,
      "exclusiveMinimum": True}, "0.0", "minimum"),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "maximum": 1,
      "exclusiveMaximum": True}, "1", "maximum"),
])
def test_bounds_are_judged_exactly_in_both_drafts(schema, text, keyword):
    violations = _violations(schema, text)
    assert len(violations) == 1 and violations[0].startswith(keyword), violations


@pytest.mark.parametrize(("schema", "text"), [
    ({"type": "number", "minimum": 0}, "1e-999"),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 0}, "0"),
    ({"type": "integer", "multipleOf": 3}, "9"),
])
def test_valid_numbers_stay_valid(schema, text):
    assert _violations(schema, text) == []


def test_an_unknown_grammar_backend_is_refused_when_the_manager_is_built():
    from servelab.samplers.structured.manager import StructuredOutputManager

    with pytest.raises(ValueError, match="grammar_backend='nope'.*valid: xgrammar"):
        StructuredOutputManager(None, 64, backend="nope")


def test_a_pipeline_with_an_unknown_grammar_backend_is_refused_when_built(tmp_path):
    from servelab import Pipeline
    from servelab.models import build_tiny_model

    with pytest.raises(ValueError, match="grammar_backend='nope'"):
        Pipeline.from_pretrained(build_tiny_model(tmp_path / "tiny"), grammar_backend="nope")


@pytest.mark.parametrize(("text", "accepted"), [
    ('{"x": 1.5e308}', True), ('{"x": -2E-123}', True), ('{"x": 12}', True),
    ('{"x": 1e1234}', False), ('{"x": 41111e-1210092402452222222222}', False),
])
def test_the_grammar_bounds_exponent_digits(text, accepted):
    pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from servelab.samplers.structured import StructuredOutputsParams
    from servelab.samplers.structured.xgrammar_backend import MAX_EXPONENT_DIGITS, json_schema_grammar

    assert MAX_EXPONENT_DIGITS == 3
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    grammar = json_schema_grammar(StructuredOutputsParams(json=schema))
    assert _is_grammar_accept_string(grammar, text) is accepted
