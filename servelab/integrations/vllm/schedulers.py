"""Bridged scheduler classes by dotted path, for vLLM's ``--scheduler-cls``.

``servelab.integrations.vllm.schedulers.<policy name>`` is
``make_scheduler_cls("<policy name>")`` (built on first access, cached)::

    vllm serve MODEL --scheduler-cls servelab.integrations.vllm.schedulers.sjf

Every name registered with ``servelab.scheduling.policies.register_policy`` works
(register it in a module the engine process imports). ``<name>_async`` builds on
vLLM's ``AsyncScheduler``.
"""

from __future__ import annotations

from servelab.integrations.vllm.scheduler import make_scheduler_cls

_CACHE: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    if name not in _CACHE:
        policy, base = (name[: -len("_async")], "async") if name.endswith("_async") else (name, None)
        try:
            _CACHE[name] = make_scheduler_cls(policy, base=base)
        except ValueError as exc:
            raise AttributeError(f"no bridged scheduler {name!r}: {exc}") from None
    return _CACHE[name]
