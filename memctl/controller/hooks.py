"""Autograd and module hooks: the saved-tensor scope and the module-attribution stack.

NOTE [ Capture window ]
A controller pushes its pack/unpack pair on autograd's thread-local stack of default
saved-tensor hooks when the model's forward starts, and removes it when the optimizer
step finishes. The window therefore also covers the loss (its saved tensors go to the
root entry) and gradient-accumulation micro-steps. Another controller, or the user's own
``saved_tensors_hooks``, may push hooks while the window is open; closing removes exactly
this controller's pair wherever it sits and puts the others back in order, so two
controllers in one process never pop each other's hooks.

The window must not outlive the step it serves. A forward under grad that no optimizer
step follows (validation without ``no_grad``, a forward that raised) would otherwise
leave the hooks pushed, and every later autograd op of the thread (another model's
forward) would be packed and counted. So the pack hook captures a tensor only inside
the model's forward, or outside it while autograd still holds what the model's current
forward saved (the loss). Any other tensor is saved as it is (plain PyTorch, with the
in-place check of NOTE [ In-place checks ]) and, when the pack hook runs in the thread
that opened the window, the hooks leave the stack there and then: the window is closed
and the next forward of the model opens it again. ``close()`` from another thread
(``detach()`` from a server or signal thread) cannot touch the owner thread's stack, so
it makes the hooks inert instead; they remove themselves at that thread's next pack.

NOTE [ Two controllers ]
Autograd hands a saved tensor to the top pair of the stack only. With two controllers on two
models trained in turn (a GAN's generator and discriminator, each with its own optimizer), a
window stays open from its model's forward to its optimizer's step, so the windows overlap:
the generator's forward opens its window above the discriminator's, still open since the
discriminator's last forward, and the discriminator's next forward found its own window open
and did not push it again. Its tensors went to the generator's hooks, which held them as
they are (saved outside the generator's forward): nothing of the discriminator's second
forward was compressed, and the generator's controller counted it. So a model's forward,
when its window is already open but not on top of this thread's stack, moves its pair to
the top (``to_top``: removed where it sits, pushed again), and each model's tensors reach
its own controller. Only other controllers' pairs are passed over, and they keep their
order: a pair that is not a controller's (a ``saved_tensors_hooks`` context of the user's,
``save_on_cpu``) stays on top, since its context pops the top pair when it exits, whoever
pushed it.

NOTE [ Forwards that enter below the model ]
The window opens when the model's own forward starts. A model that is a container (a
``ModuleDict`` of an encoder and a decoder, a GAN's two networks, a diffusion model's parts)
has no forward of its own that training calls: the loop calls ``model["enc"](x)`` and
``model["dec"](h)``, and memctl compressed nothing, silently (ratio 1.0, an ``allocation``
event "no layers saved activations"). So a submodule's forward that starts under grad outside
the model's forward, with no module running, opens the window as ``Controller.begin_step()``
does (and moves it above other controllers' pairs, NOTE [ Two controllers ]), unless it runs
inside a backward (``torch.utils.checkpoint`` recomputing a region); the tensors
are attributed to the modules as usual, the submodule's own inputs are held by reference as
the model's are (NOTE [ Model inputs ]), and the optimizer's step closes the window. The
rest of what only the model's own forward does is not done for such forwards: the batch is
not counted (``batch_size`` stays None) and the calibration probes, which replay the model's
forward, do not run, so layers keep the policy's bits before measurement (no layer gets 1
bit). A log line and an ``entry`` event say so once.

NOTE [ TorchScript submodules ]
A submodule compiled by ``torch.jit.script`` takes no Python hooks (registering one raises
``RuntimeError: ... is not supported on ScriptModules``, which ended ``Controller(...)`` for
a model holding one). Such a submodule and everything inside it are left unhooked
(:func:`hookable_modules`): its forward runs under its parent's name, and its saved tensors
go through the saved-tensor hooks as any other (they are autograd's), attributed to the
parent. A model that is itself a ScriptModule cannot be attached (a ``ConfigError``).

NOTE [ Module attribution ]
Every submodule gets a forward pre-hook that pushes its name and a forward hook (with
``always_call=True``) that pops it, so the pack hook attributes a tensor to the innermost
module running. Under ``torch.compile`` the module hooks are traced away (they return at
once while compiling) and packing happens after the compiled forward: tensors land in the
root entry and the controller reports attribution as lost instead of failing.

Both in the context of a whole step: docs/design.md, "One training step".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memctl.controller.copysafe import ControllerHook
from memctl.controller.versions import SavedRef

__all__ = ["MODEL", "ROOT", "ModuleTracker", "SavedTensorScope", "hookable_modules"]

_log = logging.getLogger("memctl.controller")

ROOT = "<root>"
"""Entry of tensors saved outside the model's forward (the loss, say)."""
MODEL = "<model>"
"""Entry of tensors saved by the model's own forward code, outside any submodule."""

PackFn = Callable[[torch.Tensor], Any]
UnpackFn = Callable[[Any], torch.Tensor]


def hookable_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``model.named_modules()`` without TorchScript modules and what they hold (NOTE
    [ TorchScript submodules ])."""
    scripted: list[str] = []
    for name, module in model.named_modules():
        if scripted and any(name.startswith(prefix) for prefix in scripted):
            continue
        if isinstance(module, torch.jit.ScriptModule):
            scripted.append(f"{name}.")
            continue
        yield name, module


class SavedTensorScope:
    """Opens and closes one controller's saved-tensor hooks (see NOTE [ Capture window ])."""

    def __init__(self, pack: PackFn, unpack: UnpackFn, capturing: Callable[[], bool] | None = None) -> None:
        self._inner_pack = pack
        self._pack: PackFn = self._pack_hook  # one bound object: close() finds it by identity
        self._unpack = unpack
        self._capturing = capturing if capturing is not None else _always
        self._thread: int | None = None
        self._inert = False

    @property
    def is_open(self) -> bool:
        return self._thread is not None

    def open(self) -> bool:
        """Push the hooks unless they are already open in this thread; True if pushed."""
        if self._thread is not None:
            return False
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
        self._thread = threading.get_ident()
        self._inert = False
        return True

    def to_top(self) -> None:
        """Move the open hooks above other controllers' pairs pushed after them, to the top of
        this thread's stack, where autograd finds them first (NOTE [ Two controllers ]); a
        pair that is not a controller's (the user's own hooks) stays on top."""
        if self._thread != threading.get_ident():
            return
        hooks = torch._C._autograd
        above: list[tuple[PackFn, UnpackFn]] = []
        while True:
            top = hooks._top_saved_tensors_default_hooks(True)
            if top is None or top[0] is self._pack or not isinstance(
                    getattr(top[0], "__self__", None), SavedTensorScope):
                break
            hooks._pop_saved_tensors_default_hooks()
            above.append((top[0], top[1]))
        mine = top is not None and top[0] is self._pack and bool(above)
        if mine:
            hooks._pop_saved_tensors_default_hooks()
        for pack, unpack in reversed(above):
            hooks._push_saved_tensors_default_hooks(pack, unpack)
        if mine:
            hooks._push_saved_tensors_default_hooks(self._pack, self._unpack)

    def _pack_hook(self, t: torch.Tensor) -> Any:
        if not self._inert and self._capturing():
            return self._inner_pack(t)
        # Outside the window (NOTE [ Capture window ]): plain PyTorch for this tensor, and
        # the hooks leave the stack if this is their thread (autograd called us, so we are on top).
        if self._thread == threading.get_ident():
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if top is not None and top[0] is self._pack:
                torch._C._autograd._pop_saved_tensors_default_hooks()
                self._thread = None
        return SavedRef(t)

    def close(self) -> None:
        """Remove this scope's hooks from the stack, leaving any others in their order."""
        if self._thread is None:
            return
        if self._thread != threading.get_ident():
            self._inert = True
            _log.info(
                "saved-tensor hooks were opened in another thread: they are inert now and leave "
                "that thread's stack at its next saved tensor"
            )
            return
        above: list[tuple[PackFn, UnpackFn]] = []
        found = False
        while True:
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if top is None:
                break
            torch._C._autograd._pop_saved_tensors_default_hooks()
            if top[0] is self._pack:
                found = True
                break
            above.append((top[0], top[1]))
        for pack, unpack in reversed(above):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        if not found:
            _log.warning("memctl's saved-tensor hooks were already removed by someone else")
        self._thread = None


class ModuleTracker:
    """Keeps the stack of running modules (see NOTE [ Module attribution ])."""

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._depth = 0
        self.current = ROOT
        """The innermost running module's name, else :data:`MODEL` inside the model's forward, else
        :data:`ROOT`: kept up to date by the hooks, since the pack hook reads it for every tensor."""
        self.module_calls = 0
        self.on_exit: Callable[[Any], None] | None = None
        """Called with each submodule's output (the packer matches region codes there)."""
        self.on_entry: Callable[[str, Any], None] | None = None
        """Called with a submodule's name and arguments when it runs outside the model's
        forward (NOTE [ Forwards that enter below the model ])."""

    @property
    def model_depth(self) -> int:
        """How many forwards of the model itself are running (the controller counts them)."""
        return self._depth

    @model_depth.setter
    def model_depth(self, depth: int) -> None:
        self._depth = depth
        if not self._stack:
            self.current = MODEL if depth > 0 else ROOT

    def attach(self, model: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Register the hooks on every submodule; returns their handles."""
        handles = []
        for name, module in hookable_modules(model):  # NOTE [ TorchScript submodules ]
            if module is model:
                continue
            pre, post = ControllerHook(self._pre_hook(name)), ControllerHook(self._post_hook(name))
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post, always_call=True))
        return handles

    def reset(self) -> None:
        self._stack.clear()
        self.model_depth = 0  # (sets current)

    def _pre_hook(self, name: str) -> Callable[..., None]:
        stack = self._stack

        def hook(module: torch.nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                return
            if not stack and self._depth == 0 and self.on_entry is not None:
                self.on_entry(name, args)  # NOTE [ Forwards that enter below the model ]
            stack.append(name)
            self.current = name
            self.module_calls += 1

        return hook

    def _post_hook(self, name: str) -> Callable[..., None]:
        stack = self._stack

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if torch.compiler.is_compiling():
                return
            if stack and stack[-1] == name:
                stack.pop()
                self.current = stack[-1] if stack else MODEL if self._depth > 0 else ROOT
            on_exit = self.on_exit
            if on_exit is not None:
                on_exit(output)

        return hook


def _always() -> bool:
    return True
