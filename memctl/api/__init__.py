"""The HTTP service: a FastAPI app over a read-only view of a controller.

``create_app(view)`` builds a fresh app (JSON endpoints, OpenAPI at ``/docs``, Prometheus
at ``/metrics``); ``serve(view)`` runs it with uvicorn on a daemon thread. FastAPI, uvicorn
and prometheus-client are imported on first use of those names, not by ``import memctl.api``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from memctl.api.view import ControllerView, StaticView, empty_snapshot

if TYPE_CHECKING:
    from memctl.api.app import create_app
    from memctl.api.metrics import SnapshotCollector, build_registry
    from memctl.api.server import ServerHandle, serve

__all__ = [
    "ControllerView",
    "ServerHandle",
    "SnapshotCollector",
    "StaticView",
    "build_registry",
    "create_app",
    "empty_snapshot",
    "serve",
]

_LAZY = {
    "create_app": "memctl.api.app",
    "SnapshotCollector": "memctl.api.metrics",
    "build_registry": "memctl.api.metrics",
    "ServerHandle": "memctl.api.server",
    "serve": "memctl.api.server",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memctl.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
