"""One check for every user object that enters through a seam.

``check_conforms(obj, Protocol, what)`` raises ``TypeError`` naming *every*
member of the Protocol the object lacks (methods must be callable), so an
object missing two methods is told about both at once. The members are read
from the Protocol class itself (its methods, properties and annotated
attributes, its bases' too), never from a hand-written list that can drift
from the contract.

Used where a user object enters: the pipeline (KV cache manager, scheduler,
sampler), the scheduler (KV cache manager), the registries' ``check``
functions (eviction policies, drafters, verifiers, attention and sampling
backends).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["check_conforms", "missing_members", "protocol_members"]

# Dunder methods a Protocol may require (the rest of the dunders belong to every class).
_DUNDERS = frozenset({"__len__", "__iter__", "__contains__", "__call__", "__getitem__"})
_IGNORED = frozenset({"_is_protocol", "_is_runtime_protocol"})


@functools.lru_cache(maxsize=None)
def protocol_members(protocol: type) -> tuple[tuple[str, bool], ...]:
    """``(name, must_be_callable)`` for every member ``protocol`` declares
    (bases included, ``Protocol`` / ``Generic`` / ``object`` excluded), sorted."""
    members: dict[str, bool] = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object,) or klass.__module__ == "typing" or klass.__module__ == "abc":
            continue
        for name in getattr(klass, "__annotations__", {}):
            if not name.startswith("_"):
                members[name] = False
        for name, value in vars(klass).items():
            if name in _IGNORED or (name.startswith("_") and name not in _DUNDERS):
                continue
            if isinstance(value, property):
                members[name] = False
            elif inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod)):
                members[name] = True
    return tuple(sorted(members.items()))


def missing_members(obj: Any, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks (methods: lacks or not callable)."""
    missing = []
    for name, must_call in protocol_members(protocol):
        if must_call:
            if not callable(getattr(obj, name, None)):
                missing.append(f"{name}()")
        elif not hasattr(obj, name):
            missing.append(name)
    return missing


def check_conforms(obj: Any, protocol: type, what: str) -> None:
    """Raise ``TypeError`` unless ``obj`` has every member of ``protocol``.

    Args:
        obj: the user's object.
        protocol: the ``typing.Protocol`` (or ABC) it must implement.
        what: the argument's name, for the message (``"kv_cache_manager"``).
    """
    missing = missing_members(obj, protocol)
    if missing:
        raise TypeError(f"{what} ({type(obj).__name__}) does not implement {protocol.__module__}."
                        f"{protocol.__qualname__}: it lacks {', '.join(missing)}")
