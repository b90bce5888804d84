"""KV connectors: KV blocks that live outside one pipeline's pool.

- :mod:`~servelab.connectors.base`: the :class:`KVConnector` contract (a
  scheduler side and a worker side, vLLM v1's method names), the per-step
  :class:`KVConnectorMetadata` and the :class:`KVTransferResult`.
- :mod:`~servelab.connectors.offload`: :class:`OffloadConnector` (``"offload"``),
  a host-memory and a disk tier under the pool.
- :mod:`~servelab.connectors.pd`: :class:`PDConnector` (``"pd"``), prefill on
  one pipeline, decode on another, with leases.

Registry: ``register_kv_connector(name, factory)``, ``get_kv_connector(name_or_obj,
**options)`` (a name builds a new connector: one serves one pipeline),
``available_kv_connectors()``. ``Pipeline(..., kv_connector=...)`` takes either.
"""

from __future__ import annotations

from typing import Any

from servelab._internal.registry import Registry
from servelab.connectors.base import KVConnector, KVConnectorMetadata, KVTransferResult, check_kv_connector

__all__ = [
    "KVConnector", "KVConnectorMetadata", "KVTransferResult", "available_kv_connectors", "check_kv_connector",
    "get_kv_connector", "register_kv_connector",
]

_CONNECTORS: Registry[KVConnector] = Registry("kv connector", factory=True, check=check_kv_connector)
_CONNECTORS.register("offload", "servelab.connectors.offload:OffloadConnector")
_CONNECTORS.register("pd", "servelab.connectors.pd:PDConnector")


def register_kv_connector(name: str, factory: Any, *, override: bool = False) -> None:
    """Register a KV connector class (or zero-or-keyword-argument factory) under ``name``."""
    _CONNECTORS.register(name, factory, override=override)


def get_kv_connector(name_or_obj: Any, **options: Any) -> KVConnector:
    """A new connector for a registered name (built with ``options``), or the object itself (checked)."""
    return _CONNECTORS.get(name_or_obj, **options)


def available_kv_connectors() -> list[str]:
    return _CONNECTORS.available()
