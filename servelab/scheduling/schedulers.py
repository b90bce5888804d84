"""The scheduler registry: whole schedulers, selectable by name in a pipeline.

A *policy* (:mod:`servelab.scheduling.policies`) changes which request goes
next inside servelab's :class:`~servelab.scheduling.Scheduler`; a *scheduler*
entry replaces the scheduler itself. An entry is a factory (usually a class)
called as ``factory(config=SchedulerConfig, kv_cache_manager=...,
policy=name_or_policy, clock=callable)`` that returns a
:class:`~servelab.scheduling.interfaces.SchedulerInterface`:

- ``"servelab"`` (default): :class:`~servelab.scheduling.Scheduler`;
- ``"vllm"``: vLLM's real v1 scheduler behind the same interface
  (:class:`servelab.integrations.vllm.pipeline_scheduler.VllmPipelineScheduler`;
  needs vLLM, imported only when this name is used).

``Pipeline(..., scheduler=NAME_OR_OBJECT)`` takes a registered name, a
factory (a ``Scheduler`` subclass) or a ready object implementing the
interface.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from servelab._internal.conformance import check_conforms
from servelab._internal.registry import Registry
from servelab.scheduling.interfaces import SchedulerInterface
from servelab.scheduling.scheduler import Scheduler

__all__ = ["DEFAULT_SCHEDULER", "available_schedulers", "check_scheduler", "get_scheduler", "register_scheduler"]

DEFAULT_SCHEDULER = "servelab"


def check_scheduler(obj: Any) -> None:
    """Raise ``TypeError`` naming what ``obj`` lacks of :class:`SchedulerInterface`."""
    check_conforms(obj, SchedulerInterface, "scheduler")


_SCHEDULERS: Registry[SchedulerInterface] = Registry("scheduler", factory=True, check=check_scheduler)
_SCHEDULERS.register("servelab", Scheduler)
_SCHEDULERS.register("vllm", "servelab.integrations.vllm.pipeline_scheduler:VllmPipelineScheduler")


def register_scheduler(name: str, factory: Callable[..., SchedulerInterface], *, override: bool = False) -> None:
    """Make ``get_scheduler(name, ...)`` (and ``Pipeline(scheduler=name)``) build schedulers with
    ``factory(config=..., kv_cache_manager=..., policy=..., clock=...)``. A name already
    registered raises ``ValueError`` unless ``override=True``."""
    _SCHEDULERS.register(name, factory, override=override)


def get_scheduler(name_or_obj: str | SchedulerInterface, **kwargs: Any) -> SchedulerInterface:
    """A new scheduler by registered name (``kwargs``: ``config``, ``kv_cache_manager``,
    ``policy``, ``clock``), or a :class:`SchedulerInterface` object as it is (checked).
    Unknown name: ``ValueError`` listing the known ones."""
    return _SCHEDULERS.get(name_or_obj, **kwargs)


def available_schedulers() -> list[str]:
    """Registered scheduler names, sorted."""
    return _SCHEDULERS.available()
