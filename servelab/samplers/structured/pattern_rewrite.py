"""Language-preserving rewrites of a JSON schema's ``pattern`` (regular expression).

Two rewrites, both used by :mod:`servelab.samplers.structured.schema_audit`
to work around what the default grammar backend compiles wrongly:

- :func:`rewrite_optional_groups`: every group quantified by ``?`` (``(G)?``,
  ``(?:G)?``, lazy ``(G)??``) becomes the alternation ``(?:G|)``. Same
  language (capture groups become non-capturing; patterns with
  backreferences are left alone). The backend's JSON-schema path mis-compiles
  some optional groups — ``^a(?:x*\\+b)?$`` lets a string stop at ``"ax"`` —
  while it compiles the alternation correctly.
- :func:`intersect_length`: ``^ATOM{lo,hi}$`` (one character class, escape,
  ``.`` or literal character, quantified by ``*``, ``+``, ``?`` or braces)
  with ``minLength``/``maxLength`` folded into the quantifier, because the
  backend drops the length bounds of a string that has a ``pattern``.

Both work on the pattern's text with a small scanner that knows escapes,
character classes (``[...]``, ``]`` first, escaped ``\\]``) and group
prefixes (``(?:``, ``(?P<name>``, ``(?<name>``, lookarounds, which are copied
untouched); anything it does not understand is returned unchanged.
"""

from __future__ import annotations

import re

__all__ = ["intersect_length", "rewrite_optional_groups"]

_BACKREFERENCE = re.compile(r"\\[1-9]|\(\?P=|\\k<")
_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


def _class_end(pattern: str, i: int) -> int:
    """Index just past the character class starting at ``pattern[i] == '['``."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    if j >= len(pattern):
        raise ValueError("unterminated character class")
    return j + 1


def _group_prefix(pattern: str, i: int) -> tuple[str, bool]:
    """The group opener at ``pattern[i] == '('`` and whether it is a lookaround."""
    for opener in _LOOKAROUND:
        if pattern.startswith(opener, i):
            return opener, True
    if pattern.startswith("(?:", i):
        return "(?:", False
    if pattern.startswith("(?P<", i) or pattern.startswith("(?<", i):
        end = pattern.index(">", i)
        return pattern[i:end + 1], False
    if pattern.startswith("(?", i):
        raise ValueError("inline flags are not rewritten")
    return "(", False


def _rewrite_sequence(pattern: str, i: int) -> tuple[str, int]:
    """Rewrite from ``i`` up to the closing ``)`` of the enclosing group (or the end)."""
    out: list[str] = []
    n = len(pattern)
    while i < n:
        c = pattern[i]
        if c == ")":
            return "".join(out), i
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
        elif c == "[":
            end = _class_end(pattern, i)
            out.append(pattern[i:end])
            i = end
        elif c == "(":
            opener, lookaround = _group_prefix(pattern, i)
            inner, close = _rewrite_sequence(pattern, i + len(opener))
            if close >= n:
                raise ValueError("unbalanced parenthesis")
            i = close + 1
            if not lookaround and i < n and pattern[i] == "?":
                i += 2 if i + 1 < n and pattern[i + 1] == "?" else 1  # lazy ?? matches the same strings
                out.append(f"(?:{inner}|)")
            else:
                out.append(f"{opener}{inner})")
        else:
            out.append(c)
            i += 1
    return "".join(out), i


def rewrite_optional_groups(pattern: str) -> str:
    """``pattern`` with every ``?``-quantified group written as ``(?:G|)`` (same language).

    Returned unchanged when it has backreferences or inline flags, or does
    not scan (unbalanced parentheses, an unterminated class).
    """
    if "(" not in pattern or _BACKREFERENCE.search(pattern):
        return pattern
    try:
        rewritten, end = _rewrite_sequence(pattern, 0)
    except (ValueError, IndexError):
        return pattern
    return rewritten if end == len(pattern) else pattern


_SINGLE_ATOM = re.compile(r"""
    \^?
    (?P<atom> \[ (?: \\. | [^\]\\] )+ \] | \\[dDwWsS] | \\[^0-9A-Za-z] | \. | [^\\\[\](){}|*+?^$.] )
    (?P<quant> \* | \+ | \? | \{ (?P<lo>\d+) (?: (?P<comma>,) (?P<hi>\d*) )? \} )
    \$?
    """, re.VERBOSE)


def intersect_length(pattern: str, min_length: int | None, max_length: int | None) -> str | None:
    """``^ATOM{lo,hi}$`` with ``[lo, hi]`` intersected with ``[min_length, max_length]``.

    None when ``pattern`` is not one quantified atom (the caller then reports
    the lengths as unenforced) or the intersection is empty. The result is
    anchored: an unanchored one-atom pattern is fully matched by the backend
    anyway (every string it accepts also contains a match).
    """
    match = _SINGLE_ATOM.fullmatch(pattern)
    if match is None:
        return None
    quant = match["quant"]
    if quant in ("*", "+", "?"):
        lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[quant]
    else:
        lo = int(match["lo"])
        hi = lo if match["comma"] is None else (int(match["hi"]) if match["hi"] else None)
    lo = max(lo, min_length or 0)
    if max_length is not None:
        hi = max_length if hi is None else min(hi, max_length)
    if hi is not None and hi < lo:
        return None
    bounds = f"{lo}," if hi is None else (f"{lo}" if hi == lo else f"{lo},{hi}")
    return f"^{match['atom']}{{{bounds}}}$"
