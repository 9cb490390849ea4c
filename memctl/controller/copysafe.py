"""Hooks that a copy of the model does not inherit.

NOTE [ Copies of an attached model ]
``copy.deepcopy(model)`` (also inside ``torch.optim.swa_utils.AveragedModel``),
``pickle.dumps(model)`` and ``torch.save(model, f)`` copy the module's hook dictionaries
with everything else. Hooks that are bound methods of the controller would drag it
along (its locks and threads cannot be pickled), and a copy that kept them would feed a
second model's forward into the first model's controller. So every module hook a
controller registers is a :class:`ControllerHook`: while attached it calls the
controller (holding it strongly, so a controller the user does not keep a name for
still runs), but a deep copy or a pickle of it is an :class:`InertHook`, which does
nothing and removes itself from the copy's hook dictionaries the first time the copy
runs. A copy is therefore plain PyTorch: it carries no controller, and
``Controller(copy)`` attaches a new one to it. Unpickling a model saved while attached
needs ``memctl`` importable (for the placeholder class), as it needs the model's class.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ControllerHook", "InertHook", "managing_hooks"]

# Dictionaries of torch.nn.Module that hold hooks or their ids (NOTE [ Copies of an attached model ]).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_ID_DICTS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class ControllerHook(functools.partial[Any]):
    """A module or optimizer hook of one controller; copies and pickles become :class:`InertHook`.

    ``ControllerHook(fn)`` calls ``fn`` with the hook's arguments. It is a ``functools.partial``
    with nothing bound, so that the call goes straight from C to ``fn``: a class with a
    ``__call__`` adds a Python frame to every module hook of every forward (two or three a
    submodule).
    """

    __slots__ = ()

    def __new__(cls, fn: Callable[..., Any]) -> ControllerHook:
        return super().__new__(cls, fn)

    def __copy__(self) -> ControllerHook:
        return self  # copy.copy(model) shares the hook dictionaries themselves anyway

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        return InertHook()

    def __reduce__(self) -> tuple[type[InertHook], tuple[()]]:
        return (InertHook, ())

    def __repr__(self) -> str:
        return f"ControllerHook({getattr(self.func, '__qualname__', self.func)!r})"


class InertHook:
    """Stands in for a :class:`ControllerHook` in a copied model: does nothing, then leaves."""

    __slots__ = ()

    def __call__(self, module: object, *args: Any, **kwargs: Any) -> None:
        if isinstance(module, torch.nn.Module):
            _remove(module, self)

    def __repr__(self) -> str:
        return "InertHook()"


def managing_hooks(model: torch.nn.Module) -> list[str]:
    """Names of the modules in ``model`` that carry a live controller's hooks."""
    names = []
    for name, module in model.named_modules():
        for dict_name in _HOOK_DICTS:
            hooks = getattr(module, dict_name, None) or {}
            if any(isinstance(h, ControllerHook) for h in hooks.values()):
                names.append(name or "<model>")
                break
    return names


def _remove(module: torch.nn.Module, hook: InertHook) -> None:
    ids = []
    for dict_name in _HOOK_DICTS:
        hooks = getattr(module, dict_name, None)
        if hooks is None:
            continue
        for hook_id, value in list(hooks.items()):
            if value is hook:
                hooks.pop(hook_id, None)
                ids.append(hook_id)
    for dict_name in _ID_DICTS:
        extra = getattr(module, dict_name, None)
        if extra is not None:
            for hook_id in ids:
                extra.pop(hook_id, None)
