"""The JSON-schema pre-pass, keyword by keyword, against the backend's own matcher.

Each case is a schema, a string the schema refuses, and (where there is one)
a string it accepts. On xgrammar 0.2.9 the plain conversion accepts the
refused string (the claim the pre-pass is built on); after the pre-pass the
backend either refuses it (a rewrite fixed it) or the audit reports the
keyword. Regex rewrites are held to Python's ``re`` on random patterns.
"""

from __future__ import annotations

import json
import re
import sys
from importlib.metadata import version

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab import StructuredOutputsParams
from servelab.samplers.structured.pattern_rewrite import intersect_length, rewrite_optional_groups
from servelab.samplers.structured.schema_audit import audit_json_schema
from servelab.samplers.structured.validation import parse_strict_json, schema_violations

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

from servelab.samplers.structured.xgrammar_backend import json_schema_grammar  # noqa: E402

XGRAMMAR_0_2_9 = version("xgrammar") == "0.2.9"
OBJ = {"a": {"type": "integer"}, "b": {"type": "integer"}}
STR = {"t": {"type": "string"}, "n": {"type": "string"}}

# name -> (schema, a string the schema refuses, a string it accepts or None, fixed (True) or reported keyword)
CASES = {
    "bounded string, control character": ({"type": "string", "maxLength": 5}, '"a\x01b"', '"ab"', True),
    "min-bounded string, control character": ({"type": "string", "minLength": 1}, '"\x01"', '"a"', True),
    "pattern + maxLength": ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcde"', '"abc"', True),
    "pattern + minLength": ({"type": "string", "pattern": "^a+$", "minLength": 3}, '"a"', '"aaa"', True),
    "pattern optional group": ({"type": "string", "pattern": r"^a(?:x*\+b)?$"}, '"ax"', '"ax+b"', True),
    "pattern optional group, middle": ({"type": "string", "pattern": r"^a(x*b)?c$"}, '"axc"', '"axbc"', True),
    "required-only anyOf": ({"type": "object", "properties": OBJ, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
                            '{"a": "s"}', '{"a": 1}', True),
    "required-only oneOf, wrong type": ({"type": "object", "properties": OBJ,
                                         "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}, "[]", '{"b": 1}', True),
    "allOf of required choices": ({"type": "object", "properties": OBJ, "allOf": [
        {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, {"required": ["a"]}]}, '{"b": 1}', '{"a": 1}', True),
    "required next to anyOf of properties": ({"type": "object", "properties": STR, "required": ["t"], "anyOf": [
        {"properties": {"t": {"enum": ["a"]}}}, {"properties": {"n": {"enum": ["b"]}}}]}, "{}", '{"t": "a"}',
        "required"),
    "anyOf mixing a required-only branch": ({"type": "object", "properties": STR, "anyOf": [
        {"properties": {"t": {"enum": ["a"]}}, "required": ["t"]}, {"required": ["t", "n"]}]}, '"s"', '{"t": "a"}',
        "type"),
    "draft-4 exclusiveMaximum": ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number",
                                  "maximum": 3, "exclusiveMaximum": True}, "3", "2", True),
    "number multipleOf": ({"type": "number", "multipleOf": 0.5}, "0.3", "1.5", "multipleOf"),
    "format + maxLength": ({"type": "string", "format": "email", "maxLength": 6}, '"abcdefg@b.co"', '"a@b.co"',
                           "maxLength"),
    "pattern + maxLength, not one atom": ({"type": "string", "pattern": "^a[0-9]+$", "maxLength": 3}, '"a1234"',
                                          '"a12"', "maxLength"),
    "allOf of two": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, '"s"', "4", "allOf"),
    "not": ({"not": {"type": "string"}}, '"s"', "1", "not"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "[1, 2]",
                    "uniqueItems"),
    "if/then": ({"type": "object", "properties": {"a": {}, "b": {}}, "if": {"properties": {"a": {"const": 1}}},
                 "then": {"required": ["b"]}}, '{"a": 1}', '{"a": 1, "b": 2}', "if"),
    "dependencies": ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                      "properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}},
                     '{"a": 1}', '{"a": 1, "b": 2}', "dependencies"),
    "oneOf exclusivity": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1", "1.5", "oneOf"),
    "$ref siblings": ({"definitions": {"x": {"type": "integer"}}, "type": "object",
                       "properties": {"a": {"$ref": "#/definitions/x", "minimum": 5}}}, '{"a": 1}', '{"a": 6}',
                      "minimum"),
    "contains": ({"type": "array", "contains": {"type": "integer"}}, '["a"]', None, "contains"),
}


def plain_grammar(schema, strict=True):
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict)


@pytest.mark.parametrize("name", list(CASES))
def test_each_keyword_is_enforced_or_reported(name):
    schema, bad, good, outcome = CASES[name]
    params = StructuredOutputsParams(json=schema, strict=name != "contains")
    assert schema_violations(params, bad)  # the case is right: the refused string violates the schema
    if XGRAMMAR_0_2_9 and name != "draft-4 exclusiveMaximum":  # that one does not even compile
        assert accepts(plain_grammar(schema, params.strict), bad), "the backend's behaviour changed: update the table"
    audit = audit_json_schema(schema, strict=params.strict)
    grammar = json_schema_grammar(params)
    if outcome is True:
        assert not accepts(grammar, bad)
        assert audit.keywords <= {"oneOf"}, audit.unenforced  # oneOf's exclusivity stays reported (test below)
    else:
        assert outcome in audit.keywords, audit.unenforced
    if good is not None:
        assert not schema_violations(params, good)
        assert accepts(grammar, good)


def test_strict_mode_refuses_min_items_without_items_and_the_rewrite_does_not():
    schema = {"type": "array", "minItems": 1}
    if XGRAMMAR_0_2_9:
        with pytest.raises(RuntimeError, match="minItems"):
            plain_grammar(schema)
    grammar = json_schema_grammar(StructuredOutputsParams(json=schema))
    assert accepts(grammar, "[1]") and not accepts(grammar, "[]")
    listed = {"type": "object", "properties": {"a": {"type": "integer"}}}
    lax = json_schema_grammar(StructuredOutputsParams(json=listed, strict=False))
    strict = json_schema_grammar(StructuredOutputsParams(json=listed))
    assert accepts(lax, '{"a": 1, "x": 1}') and not accepts(strict, '{"a": 1, "x": 1}')
    assert accepts(strict, '{"a": 1}')


def test_audit_reports_paths_and_leaves_the_input_alone():
    schema = {"type": "object", "properties": {"p": {"type": "number", "multipleOf": 0.1},
                                                "s": {"type": "string", "maxLength": 4}}}
    before = json.dumps(schema, sort_keys=True)
    audit = audit_json_schema(schema)
    assert json.dumps(schema, sort_keys=True) == before
    assert [str(u) for u in audit.unenforced] == [
        "multipleOf at /properties/p: ignored unless the type is integer and the divisor an integer"]


def test_strict_json_and_violation_messages():
    params = StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}})
    assert schema_violations(params, '{"n": 1}') == []
    assert schema_violations(params, '{"n": "x"}') == ["type at /n: 'x' is not of type 'integer'"]
    assert schema_violations(params, '"a\x01"')[0].startswith("json: not strict JSON")
    with pytest.raises(ValueError):
        parse_strict_json("NaN")


def test_validate_needs_jsonschema_and_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    with pytest.raises(ImportError, match=r"servelab\[structured\]"):
        StructuredOutputsParams(json={"type": "object"}, validate=True)
    StructuredOutputsParams(json={"type": "object"})  # without validate, jsonschema is not needed
    with pytest.raises(ValueError, match="validate=True needs json="):
        StructuredOutputsParams(regex="a", validate=False) and StructuredOutputsParams(regex="a", validate=True)
    with pytest.raises(TypeError, match="strict must be a bool"):
        StructuredOutputsParams(json={}, strict="yes")


def test_strict_is_part_of_the_cache_key():
    assert StructuredOutputsParams(json={}).key != StructuredOutputsParams(json={}, strict=False).key


# ---- regex rewrites against Python's re -----------------------------------------------------------------

ATOMS = ["a", "b", "x", r"\+", "[ab]", "[^a]", r"\d", "."]


@st.composite
def regexes(draw, depth=2):
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        if depth and draw(st.booleans()):
            inner = draw(regexes(depth=depth - 1))
            if draw(st.booleans()):
                inner += "|" + draw(regexes(depth=depth - 1))
            part = draw(st.sampled_from(["({})", "(?:{})", "(?P<g{}>{})"]))
            part = part.format(inner) if "P<" not in part else f"(?P<g{draw(st.integers(0, 99))}>{inner})"
        else:
            part = draw(st.sampled_from(ATOMS))
        parts.append(part + draw(st.sampled_from(["", "?", "??", "*", "+", "{1,2}"])))
    return "".join(parts)


@settings(max_examples=100)
@given(pattern=regexes(), subjects=st.lists(st.text(alphabet="abx+1", max_size=6), min_size=5, max_size=20))
def test_optional_group_rewrite_keeps_the_language(pattern, subjects):
    try:
        original = re.compile(pattern)
    except re.error:  # e.g. a duplicate group name
        return
    rewritten = rewrite_optional_groups(pattern)
    assert re.search(r"\)\?", rewritten) is None or "(?=" in rewritten
    compiled = re.compile(rewritten)
    for s in subjects:
        assert bool(original.fullmatch(s)) == bool(compiled.fullmatch(s)), (pattern, rewritten, s)


def test_optional_group_rewrite_leaves_what_it_cannot_handle():
    assert rewrite_optional_groups(r"(a)?\1") == r"(a)?\1"  # a backreference
    assert rewrite_optional_groups("(a?") == "(a?"  # unbalanced
    assert rewrite_optional_groups(r"[(]?(b)?") == "[(]?(?:b|)"  # a parenthesis inside a class
    assert rewrite_optional_groups("(?=a)?b") == "(?=a)?b"  # lookarounds are copied


@settings(max_examples=100)
@given(atom=st.sampled_from(["a", "[a-c]", r"\d", ".", r"\."]), quant=st.sampled_from(["*", "+", "?", "{2}", "{1,}",
                                                                                     "{0,3}"]),
       lo=st.one_of(st.none(), st.integers(0, 4)), hi=st.one_of(st.none(), st.integers(0, 5)),
       subjects=st.lists(st.text(alphabet="ab1.", max_size=7), min_size=5, max_size=20))
def test_length_intersection_is_exact(atom, quant, lo, hi, subjects):
    pattern = f"^{atom}{quant}$"
    folded = intersect_length(pattern, lo, hi)
    for s in subjects:
        want = bool(re.fullmatch(pattern, s)) and len(s) >= (lo or 0) and (hi is None or len(s) <= hi)
        assert (folded is not None and bool(re.fullmatch(folded, s))) == want, (pattern, lo, hi, folded, s)
    assert intersect_length("^a[0-9]+$", 1, 3) is None  # more than one atom: not folded
