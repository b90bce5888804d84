"""Argument checks shared by every layer: one wording for every bad value.

Each helper returns the value it accepted (so a check can sit in an
assignment) and raises, naming the argument, the value and what is valid:

- ``TypeError`` when the value has the wrong type (``bool`` is never an int:
  ``True`` for a block count is a bug, not a 1);
- ``ValueError`` when the type is right but the value is out of range.

Hot paths inline the cheap ``type(x) is int and x >= 0`` test and call these
helpers only to build the message, so the wording stays in one place::

    if type(n) is not int or n < 0:
        check_int("num_new_tokens", n, min_value=0)
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_bool", "check_int", "check_number"]


def _range_text(min_value: float | None, max_value: float | None) -> str:
    if min_value is not None and max_value is not None:
        return f"in [{min_value}, {max_value}]"
    if min_value == 1 and max_value is None:
        return "a positive integer (>= 1)"
    if min_value is not None:
        return f">= {min_value}"
    return f"<= {max_value}"


def check_int(name: str, value: Any, *, min_value: int | None = None, max_value: int | None = None) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) within ``[min_value, max_value]``.

    Args:
        name: the argument as the caller knows it (``"num_blocks"``,
            ``"request.num_computed_tokens"``).
        value: what was passed.
        min_value, max_value: inclusive bounds; None means unbounded.

    Raises:
        TypeError: ``value`` is not an int (floats such as ``2.0`` included).
        ValueError: ``value`` is out of range; the message gives the range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if (min_value is not None and value < min_value) or (max_value is not None and value > max_value):
        raise ValueError(f"{name}={value!r} must be {_range_text(min_value, max_value)}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a ``bool``; ``0`` / ``1`` / ``"yes"`` are refused (TypeError)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def check_number(name: str, value: Any, *, min_value: float | None = None, max_value: float | None = None,
                 max_exclusive: bool = False) -> float:
    """``value`` as a float if it is a finite real number (int or float, not
    bool) within ``[min_value, max_value]`` (``max_value`` excluded when
    ``max_exclusive``). NaN and infinities are refused (ValueError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    value = float(value)
    too_high = max_value is not None and (value >= max_value if max_exclusive else value > max_value)
    if not math.isfinite(value) or (min_value is not None and value < min_value) or too_high:
        if min_value is not None and max_value is not None:
            valid = f"in [{min_value}, {max_value}{')' if max_exclusive else ']'}"
        elif min_value is not None:
            valid = f"finite and >= {min_value}"
        elif max_value is not None:
            valid = f"finite and {'<' if max_exclusive else '<='} {max_value}"
        else:
            valid = "finite"
        raise ValueError(f"{name}={value!r} must be {valid}")
    return value
