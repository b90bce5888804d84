"""One registry helper for every named, swappable piece.

Every seam that can be selected by name (attention backends, scheduling
policies, eviction policies, drafters, verifiers, sampling backends, grammar
backends) keeps a :class:`Registry` and exposes three module-level functions
with the same naming everywhere::

    register_X(name, obj, *, override=False)   # duplicate name -> ValueError unless override
    get_X(name_or_obj, **kwargs)               # unknown name -> ValueError listing the known names
    available_X()                              # sorted list of names

An entry is either the object itself or a lazy ``"package.module:attribute"``
string, imported on first :meth:`Registry.get`; lazy entries keep optional
dependencies (Triton, xgrammar, the references) out of import time.

With ``factory=True`` an entry is a class or callable and ``get`` calls it
with ``**kwargs`` (policies: ``get_policy("vtc", output_weight=4.0)``); an
object that is not a string is checked by ``check`` (if given) and returned
as it is, so every ``get_X`` accepts "a name or an object implementing the
protocol".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry"]


class Registry(Generic[T]):
    """Names -> objects (or factories) for one kind of piece.

    Args:
        kind: what is registered, used in messages (``"attention backend"``).
        factory: entries are factories; :meth:`get` calls them with ``**kwargs``.
        check: called on every object a user passes instead of a name (and on
            every registered non-lazy object); raises ``TypeError`` saying what
            is missing.
    """

    def __init__(self, kind: str, *, factory: bool = False,
                 check: Callable[[Any], None] | None = None) -> None:
        self.kind = kind
        self.factory = factory
        self.check = check
        self._entries: dict[str, Any] = {}

    def register(self, name: str, obj: Any, *, override: bool = False) -> None:
        """Add ``name`` -> ``obj``; ``obj`` may be a lazy ``"module:attr"`` string."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"{self.kind} name={name!r} is invalid; valid: a non-empty string "
                             "without surrounding spaces")
        if name in self._entries and not override:
            raise ValueError(f"{self.kind} {name!r} is already registered; pass override=True to replace it")
        if not _is_lazy(obj) and self.check is not None and not self.factory:
            self.check(obj)
        self._entries[name] = obj

    def available(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def lookup(self, name: str) -> Any:
        """The registered entry for ``name`` (lazy strings imported), not instantiated."""
        if not isinstance(name, str):
            raise TypeError(f"{self.kind} name must be a str, got {type(name).__name__}")
        try:
            entry = self._entries[name]
        except KeyError:
            known = ", ".join(repr(n) for n in self.available()) or "none"
            raise ValueError(f"unknown {self.kind} {name!r}; known: {known}") from None
        if _is_lazy(entry):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
            self._entries[name] = entry
        return entry

    def get(self, name_or_obj: Any, **kwargs: Any) -> T:
        """The object for a name (instantiated with ``kwargs`` for factories),
        or ``name_or_obj`` itself when it is not a string (after ``check``)."""
        if isinstance(name_or_obj, str):
            entry = self.lookup(name_or_obj)
            return entry(**kwargs) if self.factory else entry
        if kwargs:
            raise TypeError(f"options {sorted(kwargs)} apply to a {self.kind} given by name, "
                            f"not to an object ({type(name_or_obj).__name__})")
        if self.check is not None:
            self.check(name_or_obj)
        return name_or_obj


def _is_lazy(obj: Any) -> bool:
    return isinstance(obj, str) and ":" in obj
