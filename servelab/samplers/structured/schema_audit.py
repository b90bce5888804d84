"""The JSON-schema pre-pass: what the grammar backend will not enforce, and safe rewrites.

:func:`audit_json_schema` runs when a request with ``json=`` is added. It walks
every subschema and returns a :class:`SchemaAudit`:

- ``schema``: the schema the backend compiles — the user's schema with
  language-preserving (or language-narrowing, never widening) rewrites;
- ``unenforced``: one :class:`Unenforced` per keyword the backend will not
  enforce (JSON pointer, keyword, why). An output that finishes with
  ``"stop"`` can violate only these; the pipeline warns once when the request
  is added and puts the list on the output (``structured_unenforced``).

What the default backend (xgrammar 0.2.9, JSON-schema path) does, checked
keyword by keyword against its matcher (tests/structured/test_schema_audit.py
holds each case), and what this pass does about it:

=====================================================  ======================
backend behaviour                                      here
=====================================================  ======================
``multipleOf`` ignored unless the type is integer      reported
and the divisor an integer
``minLength``/``maxLength`` dropped next to            folded into a one-atom
``pattern`` (and next to ``format``)                   pattern; else reported
a ``?``-quantified group in ``pattern`` lets the       rewritten ``(?:G|)``
string stop inside it (``^a(?:x*\\+b)?$`` takes "ax")
``anyOf``/``oneOf`` whose branches hold only           sibling keywords merged
``required``: sibling ``type``/``properties``          into every branch
ignored (anything is accepted)
other keywords next to ``anyOf``/``oneOf``: may be    reported (with the
dropped (e.g. a sibling ``required`` next to           combinator)
branches holding ``properties``)
``oneOf``: exclusivity not enforced (acts as anyOf)    reported unless the
                                                       branches are disjoint
``allOf`` with two or more branches: the whole        flattened when its parts
subschema is ignored                                   are ``required`` and
                                                       required-only ``anyOf``;
                                                       else reported (with
                                                       every sibling keyword)
``not``, ``if``/``then``/``else``, ``uniqueItems``,    reported
``contains``/``minContains``/``maxContains``,
``dependencies``/``dependentRequired``/
``dependentSchemas``, ``unevaluated*``: ignored
``$ref`` with sibling keywords: siblings ignored       reported
``propertyNames`` next to ``properties`` or            reported
``patternProperties``: ignored
draft-4 boolean ``exclusiveMinimum``/``Maximum``:      rewritten to the
compile error                                          numeric form
draft-4 array-form ``items``: compile error            rewritten to
                                                       ``prefixItems``
strict mode: ``minItems`` without ``items`` refused    ``items: {}`` added
bounded strings admit raw control characters           fixed in the compiled
                                                       grammar (backend)
=====================================================  ======================

``format`` is an annotation (JSON Schema's default: validators do not assert
it), so formats the backend does not know are not reported.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from servelab.samplers.structured.pattern_rewrite import intersect_length, rewrite_optional_groups

__all__ = ["SchemaAudit", "Unenforced", "audit_json_schema"]

MAX_PRODUCT = 64
"""Most ``anyOf`` branches an ``allOf`` of required-only choices is flattened into."""
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "$schema", "$id", "id",
                          "deprecated", "readOnly", "writeOnly"})
_DEFINITIONS = frozenset({"$defs", "definitions"})  # stay where they are: $refs point at them from the root
_IGNORED = {
    "not": "ignored", "if": "if/then/else ignored", "uniqueItems": "ignored", "contains": "ignored",
    "minContains": "ignored", "maxContains": "ignored", "dependencies": "ignored",
    "dependentRequired": "ignored", "dependentSchemas": "ignored", "unevaluatedProperties": "ignored",
    "unevaluatedItems": "ignored",
}
# Where subschemas live: keyword -> "one" (a schema), "map" (name -> schema), "list" (schemas).
_CHILDREN = {
    "properties": "map", "patternProperties": "map", "$defs": "map", "definitions": "map",
    "dependentSchemas": "map", "dependencies": "map", "items": "one", "additionalProperties": "one",
    "additionalItems": "one", "not": "one", "if": "one", "then": "one", "else": "one", "contains": "one",
    "propertyNames": "one", "unevaluatedProperties": "one", "unevaluatedItems": "one", "anyOf": "list",
    "oneOf": "list", "allOf": "list", "prefixItems": "list",
}


@dataclass(frozen=True)
class Unenforced:
    """A keyword the backend will not enforce: where (JSON pointer), which, and why."""

    path: str
    keyword: str
    reason: str

    def __str__(self) -> str:
        return f"{self.keyword} at {self.path or '/'}: {self.reason}"


@dataclass(frozen=True)
class SchemaAudit:
    """The pre-pass result: the schema to compile, what stays unenforced, what was rewritten."""

    schema: Any
    unenforced: tuple[Unenforced, ...]
    rewrites: tuple[str, ...]

    @property
    def keywords(self) -> frozenset[str]:
        """The unenforced keywords' names."""
        return frozenset(u.keyword for u in self.unenforced)


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


class _Auditor:
    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.unenforced: list[Unenforced] = []
        self.rewrites: list[str] = []

    def report(self, path: str, keyword: str, reason: str) -> None:
        self.unenforced.append(Unenforced(path, keyword, reason))

    def rewrote(self, path: str, what: str) -> None:
        self.rewrites.append(f"{path or '/'}: {what}")

    # ---- one node ------------------------------------------------------------

    def visit(self, node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        self._rewrite_draft4(node, path)
        self._flatten_required_all_of(node, path)
        self._check_numbers(node, path)
        self._check_strings(node, path)
        self._check_arrays(node, path)
        self._check_combinators(node, path)
        for keyword, reason in _IGNORED.items():
            if keyword in node and not (keyword == "uniqueItems" and node[keyword] is not True):
                self.report(path, keyword, reason)
        for child, child_path in _children(node, path):
            self.visit(child, child_path)
        # Last: the branches get copies of the siblings as audited (and reported) at this path.
        self._distribute_required_branches(node, path)

    def _rewrite_draft4(self, node: dict[str, Any], path: str) -> None:
        for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(node.get(flag), bool):
                if node.pop(flag) and bound in node:
                    node[flag] = node.pop(bound)
                self.rewrote(path, f"draft-4 boolean {flag} -> numeric form")
        items = node.get("items")
        if isinstance(items, list):
            node["prefixItems"] = node.pop("items")
            if "additionalItems" in node:
                node["items"] = node.pop("additionalItems")
            self.rewrote(path, "draft-4 array-form items -> prefixItems")

    def _flatten_required_all_of(self, node: dict[str, Any], path: str) -> None:
        """``allOf`` of ``{required}`` and ``{anyOf: [{required}...]}`` -> one ``required`` and one
        ``anyOf`` over the product of the choices (exact; at most :data:`MAX_PRODUCT` branches)."""
        parts = node.get("allOf")
        if not isinstance(parts, list) or not parts or "oneOf" in node:
            return
        choices: list[list[list[str]]] = []
        required = list(node.get("required", []))
        own = [{"anyOf": node["anyOf"]}] if "anyOf" in node else []
        for part in own + parts:
            if not isinstance(part, dict) or not set(part) <= _ANNOTATIONS | {"required", "anyOf"}:
                return
            if not all(isinstance(r, str) for r in part.get("required", [])):
                return
            required += [r for r in part.get("required", []) if r not in required]
            if "anyOf" in part:
                branches = part["anyOf"]
                if not isinstance(branches, list) or not branches or not all(
                        isinstance(b, dict) and set(b) <= _ANNOTATIONS | {"required"} for b in branches):
                    return
                choices.append([list(b.get("required", [])) for b in branches])
        combos: list[list[str]] = [[]]
        for options in choices:
            combos = [c + [r for r in option if r not in c] for c in combos for option in options]
            if len(combos) > MAX_PRODUCT:
                return
        del node["allOf"]
        node.pop("anyOf", None)
        if required:
            node["required"] = required
        if choices:
            node["anyOf"] = [{"required": combo} for combo in combos]
        self.rewrote(path, f"allOf of required-only parts -> required + anyOf of {len(combos)} branches")

    def _distribute_required_branches(self, node: dict[str, Any], path: str) -> None:
        """``S + anyOf/oneOf[{required: R_i}]`` -> ``anyOf/oneOf[S + {required: R_i}]`` (exact)."""
        combinators = [k for k in ("anyOf", "oneOf") if isinstance(node.get(k), list)]
        if not _required_only(node, combinators):
            return
        key = combinators[0]
        branches = node[key]
        siblings = {k: v for k, v in node.items() if k != key and k not in _ANNOTATIONS | _DEFINITIONS}
        if not siblings or "$ref" in siblings:
            return
        merged = []
        for branch in branches:
            combined = copy.deepcopy(siblings)
            extra = [r for r in branch.get("required", []) if r not in combined.get("required", [])]
            combined["required"] = list(combined.get("required", [])) + extra
            merged.append(combined)
        for k in siblings:
            del node[k]
        node[key] = merged
        self.rewrote(path, f"{key} branches holding only 'required' got the sibling keywords")

    def _check_numbers(self, node: dict[str, Any], path: str) -> None:
        divisor = node.get("multipleOf")
        if divisor is None:
            return
        if not (_types(node) == {"integer"} and isinstance(divisor, int) and not isinstance(divisor, bool)):
            self.report(path, "multipleOf", "ignored unless the type is integer and the divisor an integer")

    def _check_strings(self, node: dict[str, Any], path: str) -> None:
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            rewritten = rewrite_optional_groups(pattern)
            if rewritten != pattern:
                node["pattern"] = pattern = rewritten
                self.rewrote(path, "pattern's optional groups -> alternations")
        lengths = [k for k in ("minLength", "maxLength") if k in node]
        if not lengths or not ("pattern" in node or "format" in node):
            return
        if isinstance(pattern, str) and "format" not in node:
            folded = intersect_length(pattern, node.get("minLength"), node.get("maxLength"))
            if folded is not None:
                node["pattern"] = folded
                for k in lengths:
                    del node[k]
                self.rewrote(path, "minLength/maxLength folded into the pattern")
                return
        for k in lengths:
            self.report(path, k, "dropped next to pattern/format")

    def _check_arrays(self, node: dict[str, Any], path: str) -> None:
        if (self.strict and node.get("minItems", 0) and "items" not in node and "prefixItems" not in node
                and _types(node) <= {"array"}):
            node["items"] = {}
            self.rewrote(path, "items: {} added (strict mode refuses minItems without items)")

    def _check_combinators(self, node: dict[str, Any], path: str) -> None:
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) >= 2:
            self.report(path, "allOf", "two or more branches: the backend ignores this whole subschema")
            for k in sorted(set(node) - _ANNOTATIONS - {"allOf", "$defs", "definitions"}):
                self.report(path, k, "ignored: the subschema has an allOf with two or more branches")
        combinators = [k for k in ("anyOf", "oneOf") if isinstance(node.get(k), list)]
        siblings = sorted(set(node) - _ANNOTATIONS - {"anyOf", "oneOf", "allOf", "$defs", "definitions"})
        if combinators and siblings and not _required_only(node, combinators):
            for k in combinators + siblings:
                self.report(path, k, "the backend may drop keywords next to anyOf/oneOf (enforced only when "
                                     "every branch holds just 'required')")
        if isinstance(node.get("oneOf"), list) and len(node["oneOf"]) >= 2 and not _disjoint(node["oneOf"]):
            self.report(path, "oneOf", "exclusivity is not enforced (acts as anyOf)")
        if "$ref" in node:
            siblings = sorted(set(node) - _ANNOTATIONS - {"$ref", "$defs", "definitions"})
            for k in siblings:
                self.report(path, k, "ignored next to $ref")
        if "propertyNames" in node and ("properties" in node or "patternProperties" in node):
            self.report(path, "propertyNames", "ignored next to properties/patternProperties")


def _required_only(node: dict[str, Any], combinators: list[str]) -> bool:
    """One of anyOf/oneOf, every branch ``{required: [...]}`` (annotations aside), no ``$ref`` next to it:
    the shape whose siblings can be distributed into the branches exactly."""
    if len(combinators) != 1 or "$ref" in node:
        return False
    branches = node[combinators[0]]
    return bool(branches) and all(isinstance(b, dict) and set(b) <= _ANNOTATIONS | {"required"} for b in branches)


def _children(node: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    for keyword, shape in _CHILDREN.items():
        value = node.get(keyword)
        if shape == "one" and isinstance(value, dict):
            yield value, f"{path}/{keyword}"
        elif shape == "map" and isinstance(value, dict):
            for name, child in value.items():
                yield child, f"{path}/{keyword}/{_escape(name)}"
        elif shape == "list" and isinstance(value, list):
            for i, child in enumerate(value):
                yield child, f"{path}/{keyword}/{i}"


def _escape(name: Any) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _discriminators(branch: Any) -> dict[str, frozenset[str]]:
    """Required properties pinned by const/enum: property -> JSON texts of the values allowed."""
    if not isinstance(branch, dict) or not isinstance(branch.get("properties"), dict):
        return {}
    pinned = {}
    for name in branch.get("required", []):
        prop = branch["properties"].get(name)
        if isinstance(prop, dict) and "const" in prop:
            pinned[name] = frozenset([json.dumps(prop["const"], sort_keys=True)])
        elif isinstance(prop, dict) and isinstance(prop.get("enum"), list):
            pinned[name] = frozenset(json.dumps(v, sort_keys=True) for v in prop["enum"])
    return pinned


def _disjoint(branches: list[Any]) -> bool:
    """Whether no value can satisfy two branches: different types, or a pinned property with disjoint values."""
    for i, a in enumerate(branches):
        for b in branches[i + 1:]:
            if not isinstance(a, dict) or not isinstance(b, dict):
                return False
            ta, tb = _types(a), _types(b)
            ta, tb = ta | ({"number"} if "integer" in ta else set()), tb | ({"number"} if "integer" in tb else set())
            if ta and tb and not (ta & tb):  # an integer is a number
                continue
            da, db = _discriminators(a), _discriminators(b)
            if any(da[k].isdisjoint(db[k]) for k in da.keys() & db.keys()):
                continue
            return False
    return True


def audit_json_schema(schema: Any, *, strict: bool = True) -> SchemaAudit:
    """Audit (and safely rewrite) ``schema`` for the default backend; the input is not modified.

    Args:
        schema: a JSON schema (dict or bool).
        strict: compiled in strict mode (no properties or items beyond those
            the schema lists); enables the strict-only rewrites.
    """
    auditor = _Auditor(strict)
    rewritten = copy.deepcopy(schema)
    auditor.visit(rewritten, "")
    return SchemaAudit(rewritten, tuple(auditor.unenforced), tuple(auditor.rewrites))
