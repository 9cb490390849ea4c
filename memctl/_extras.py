"""Optional dependencies: find out whether an extra is installed, and say which one to install.

NOTE [ Lean core, optional extras ]
The core install is what the controller, the monitor and the HTTP API need. The demo
(scikit-learn, matplotlib), the trainer integrations (Lightning, transformers), TensorBoard
logging and the benchmarks each live in an extra. Code that needs an extra calls
:func:`require` first, so a missing package is a one-line :class:`MissingExtraError` naming
the ``pip install`` to run rather than an ``ImportError`` from deep inside a run. Looking a
module up (``importlib.util.find_spec``) does not import it.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from memctl.errors import MissingExtraError

__all__ = ["EXTRAS", "import_extra", "missing", "require"]

#: extra name -> (import name, distribution name) of the packages it provides.
EXTRAS: dict[str, tuple[tuple[str, str], ...]] = {
    "demo": (("sklearn", "scikit-learn"), ("matplotlib", "matplotlib")),
    "lightning": (("lightning", "lightning"),),
    "huggingface": (("transformers", "transformers"), ("accelerate", "accelerate")),
    "tensorboard": (("tensorboard", "tensorboard"),),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a module with no spec
        return False


def missing(extra: str) -> list[str]:
    """Distribution names of ``extra`` that are not installed (empty when all are)."""
    if extra not in EXTRAS:
        raise KeyError(f"unknown extra {extra!r}; known: {sorted(EXTRAS)}")
    return [dist for module, dist in EXTRAS[extra] if not _installed(module)]


def require(extra: str, feature: str) -> None:
    """Raise :class:`MissingExtraError` when a package of ``extra`` is missing for ``feature``."""
    absent = missing(extra)
    if absent:
        raise MissingExtraError(
            f"{feature} needs {', '.join(absent)}, which {'is' if len(absent) == 1 else 'are'} not "
            f"installed; install memctl's '{extra}' extra: pip install 'memctl[{extra}]' "
            f"(from a checkout: pip install -e '.[{extra}]')"
        )


def import_extra(module: str, extra: str, feature: str) -> ModuleType:
    """:func:`require`, then import ``module``; a package that is installed but fails to import
    (most often a ``torchvision`` built for another torch, which Lightning and transformers
    import) is a :class:`MissingExtraError` that says so, not a ``RuntimeError`` from deep inside.
    """
    require(extra, feature)
    try:
        return importlib.import_module(module)
    except Exception as exc:
        import torch

        raise MissingExtraError(
            f"{feature}: {module} is installed but importing it failed ({type(exc).__name__}: {exc}). "
            f"A package it imports is broken; often that is a torchvision built for another torch: "
            f"install the torchvision release that matches torch {torch.__version__}, or uninstall "
            "torchvision if nothing needs it"
        ) from exc
