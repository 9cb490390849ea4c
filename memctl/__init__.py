"""memctl: a runtime memory manager for PyTorch training.

memctl compresses the activations that autograd saves for the backward pass and
decides, layer by layer and step by step, how hard to compress them so that
training stays inside a memory budget that can change while it runs.

Importing this package is cheap: it initialises no CUDA context, no NVML handle
and compiles no kernel. Public names are resolved lazily on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from memctl._version import __version__
from memctl.errors import BudgetError, CodecError, ConfigError, MemctlError

if TYPE_CHECKING:
    from memctl.controller.config import CodecMode, ControllerConfig, Objective
    from memctl.controller.controller import Controller
    from memctl.controller.sampler import AdaptiveBatchSampler

__all__ = [
    "AdaptiveBatchSampler",
    "BudgetError",
    "CodecError",
    "CodecMode",
    "ConfigError",
    "Controller",
    "ControllerConfig",
    "MemctlError",
    "Objective",
    "__version__",
]

_LAZY = {
    "Controller": "memctl.controller.controller",
    "AdaptiveBatchSampler": "memctl.controller.sampler",
    "ControllerConfig": "memctl.controller.config",
    "CodecMode": "memctl.controller.config",
    "Objective": "memctl.controller.config",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memctl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
