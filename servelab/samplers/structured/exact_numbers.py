"""Numeric JSON Schema keywords judged on the number as written, exactly.

Python's ``float`` reads ``41111e-1210092402452222222222`` as ``0.0`` and
``1e400`` as ``inf``: a validator working on floats then passes
``{"total": 41111e-1210...}`` against ``multipleOf: 0.01`` (0.0 is a
multiple of everything) although the number written is not. Model outputs
under a grammar can write such numbers (nothing bounds exponent digits).

Here a JSON number is parsed from its text into an exact decimal
``mantissa * 10**exponent`` (Python ints: the exponent may have any number
of digits) and ``multipleOf``, ``minimum``, ``maximum``,
``exclusiveMinimum`` and ``exclusiveMaximum`` are decided without ever
building ``10**exponent`` for an astronomical exponent:

- comparison: numbers of different sign, or of different order of
  magnitude (``exponent + digits``), are ordered by those alone; only
  numbers of the same magnitude are scaled to a common exponent (a
  difference bounded by their digit counts);
- ``x`` is a multiple of ``d`` iff ``x / d`` is an integer: with
  ``x = m 10^e``, ``d = n 10^f`` and ``g = e - f``: for ``g >= 0``, ``n /
  gcd(n, m)`` must be ``2^a 5^b`` with ``a, b <= g``; for ``g < 0``,
  ``n 10^-g`` must divide ``m``, impossible for non-zero ``m`` once ``-g``
  exceeds ``m``'s digit count.

Schema values given as Python floats are read as their shortest ``repr``
(the literal the schema's author wrote).
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

__all__ = ["ExactNumber", "NumberLiteral", "compare", "is_multiple", "to_exact"]

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")


class NumberLiteral(float):
    """A JSON number as a float (for everything else) that keeps the text it was written as."""

    text: str

    def __new__(cls, text: str) -> NumberLiteral:
        obj = super().__new__(cls, float(text))
        obj.text = text
        return obj


class ExactNumber(NamedTuple):
    """``mantissa * 10**exponent``, exactly; ``mantissa`` carries the sign (0 has exponent 0)."""

    mantissa: int
    exponent: int

    @property
    def magnitude(self) -> int:
        """``exponent + digits``: ``10**(magnitude-1) <= |x| < 10**magnitude`` (0 for zero)."""
        return self.exponent + len(str(abs(self.mantissa))) if self.mantissa else 0


def parse_literal(text: str) -> ExactNumber:
    """The exact value of a JSON number's text; ``ValueError`` if it is not one."""
    match = _NUMBER.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a JSON number")
    whole, fraction, exp = match.group(1), (match.group(2) or ".")[1:], match.group(3)
    exponent = (int(exp[1:]) if exp else 0) - len(fraction)
    mantissa = int(whole + fraction) * (-1 if text.strip().startswith("-") else 1)
    if mantissa == 0:
        return ExactNumber(0, 0)
    while mantissa % 10 == 0:  # normalise: trailing zeros into the exponent (bounded by the digits written)
        mantissa //= 10
        exponent += 1
    return ExactNumber(mantissa, exponent)


def to_exact(value: Any) -> ExactNumber | None:
    """The exact value of a JSON number (:class:`NumberLiteral`, int, finite float); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, NumberLiteral):
        return parse_literal(value.text)
    if isinstance(value, int):
        return parse_literal(str(value))
    if isinstance(value, float) and math.isfinite(value):
        return parse_literal(_float_text(value))
    return None


def _float_text(value: float) -> str:
    text = repr(value)
    return text if "e" in text or "." in text else text + ".0"


def compare(a: ExactNumber, b: ExactNumber) -> int:
    """-1, 0 or 1 as ``a <, ==, > b``, exactly, for exponents of any size."""
    sign_a, sign_b = (a.mantissa > 0) - (a.mantissa < 0), (b.mantissa > 0) - (b.mantissa < 0)
    if sign_a != sign_b or sign_a == 0:
        return (sign_a > sign_b) - (sign_a < sign_b)
    if a.magnitude != b.magnitude:  # same sign: the larger magnitude is further from zero
        bigger = 1 if a.magnitude > b.magnitude else -1
        return bigger * sign_a
    low = min(a.exponent, b.exponent)  # same magnitude: the exponents differ by at most the digit counts
    x, y = a.mantissa * 10 ** (a.exponent - low), b.mantissa * 10 ** (b.exponent - low)
    return (x > y) - (x < y)


def is_multiple(x: ExactNumber, divisor: ExactNumber) -> bool:
    """Whether ``x / divisor`` is an integer (``divisor`` non-zero), exactly."""
    if divisor.mantissa == 0:
        raise ValueError("multipleOf must be > 0")
    m, n, g = abs(x.mantissa), abs(divisor.mantissa), x.exponent - divisor.exponent
    if m == 0:
        return True
    if g < 0:
        if -g > len(str(m)):  # 10**-g > m: a non-zero m cannot hold that many factors of ten
            return False
        return m % (n * 10 ** -g) == 0
    rest = n // math.gcd(n, m)
    twos = fives = 0
    while rest % 2 == 0:
        rest //= 2
        twos += 1
    while rest % 5 == 0:
        rest //= 5
        fives += 1
    return rest == 1 and max(twos, fives) <= g


def show(value: Any) -> str:
    """A number as written (a literal's own text; an int or float as Python prints it)."""
    return value.text if isinstance(value, NumberLiteral) else repr(value)
