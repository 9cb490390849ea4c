"""Recognising FSDP2 (``torch.distributed.fsdp.fully_shard``) parameters in the pack hook.

NOTE [ FSDP2 parameters ]
Under ``fully_shard`` a module's registered parameters are sharded DTensors; reading
their storage directly fails ("invalid python storage"), so every storage read goes
through :func:`local_tensor`. For forward, FSDP all-gathers each parameter into a flat
buffer (``FSDPParam.all_gather_outputs``) and swaps in an unsharded ``nn.Parameter``
(``FSDPParam._unsharded_param``), a view of that buffer; after forward it frees the
buffer (``storage.resize_(0)``) and gathers it again for backward. The unsharded
parameter is what autograd saves, so the pack hook must hand it back untouched: a
copy or a compressed record would hold a second full parameter for the whole backward
(undoing FSDP's memory saving) and, compressed, would perturb the weight gradient's
input. Storage addresses taken at attach time do not find these buffers (they do not
exist yet, and their data pointer changes with every gather), so the parameters are
recognised by their *storage objects*: the ``StorageImpl`` behind FSDP's all-gather
outputs, unsharded parameters and sharded locals, read from FSDP's own ``FSDPParam``
objects. A storage object survives ``resize_`` (its key stays the same while its data
pointer moves) and FSDP keeps it alive as long as the model, so a key can never be
mistaken for an activation's. The keys are refreshed in a forward pre-hook on each
FSDP module (after FSDP's own pre-forward, which it registers with ``prepend=True``
and which creates the buffers on the first gather) and at every step boundary.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memctl.controller.copysafe import ControllerHook

__all__ = ["FsdpParameters", "local_tensor", "storage_key"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard when it is a DTensor, else ``t`` (DTensor storages cannot be read)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of the storage object behind ``t`` (stable across ``resize_``), or None."""
    try:
        return int(local_tensor(t).untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _fsdp_states(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """``(module, FSDPState)`` for every ``fully_shard`` module in ``model`` (none without FSDP2)."""
    # A model sharded with fully_shard has imported FSDP already; without it there is nothing
    # to find, and attaching does not pay for importing FSDP.
    if not torch.distributed.is_available() or "torch.distributed.fsdp" not in sys.modules:
        return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return []
    found: list[tuple[torch.nn.Module, Any]] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            try:
                found.append((module, module._get_fsdp_state()))
            except (AssertionError, AttributeError, RuntimeError):
                continue
    return found


def _state_params(state: Any) -> Iterator[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    for group in groups:
        yield from getattr(group, "fsdp_params", ())


def _param_tensors(fsdp_param: Any) -> Iterator[torch.Tensor]:
    """Every tensor of one ``FSDPParam`` whose storage may reach autograd or hold the weight."""
    attrs = fsdp_param.__dict__
    unsharded = attrs.get("_unsharded_param")
    if isinstance(unsharded, torch.Tensor):
        yield unsharded
    for t in itertools.chain(attrs.get("all_gather_outputs") or (),
                             attrs.get("_unsharded_inner_tensors") or ()):
        if isinstance(t, torch.Tensor):
            yield t
    for name in ("_sharded_param_data", "sharded_param", "_sharded_post_forward_param_data"):
        t = attrs.get(name)
        if isinstance(t, torch.Tensor):
            yield t


class FsdpParameters:
    """The storage keys of every FSDP2 parameter of one model (NOTE [ FSDP2 parameters ]).

    ``contains(t)`` is the pack hook's test; it costs one storage read and a set lookup.
    Empty, and free, for a model without ``fully_shard`` modules.
    """

    def __init__(self) -> None:
        self._states: list[Any] = []
        self._keys: set[int] = set()
        self.active = False
        """Whether the model has FSDP states (an attribute: the pack hook reads it for every tensor)."""

    @property
    def keys(self) -> frozenset[int]:
        return frozenset(self._keys)

    def attach(self, model: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Find the FSDP states and hook each FSDP module's forward; returns the handles."""
        states = _fsdp_states(model)
        self._states = [s for _, s in states]
        self.active = bool(self._states)
        self.refresh()
        ref = weakref.ref(self)
        # A ControllerHook, so copies and pickles of the model leave it behind
        # (NOTE [ Copies of an attached model ] in memctl/controller/copysafe.py).
        return [m.register_forward_pre_hook(ControllerHook(_refresh_hook(ref, s))) for m, s in states]

    def refresh(self) -> None:
        """Re-read every storage key from FSDP's parameter objects (at a step boundary)."""
        self._keys = set()
        for state in self._states:
            self.add_state(state)

    def add_state(self, state: Any) -> None:
        """Add the keys of one FSDP state's parameters (its module's forward pre-hook)."""
        for fsdp_param in _state_params(state):
            for t in _param_tensors(fsdp_param):
                key = storage_key(t)
                if key is not None:
                    self._keys.add(key)

    def contains(self, t: torch.Tensor) -> bool:
        return bool(self._keys) and storage_key(t) in self._keys

    def detach(self) -> None:
        self._states = []
        self.active = False
        self._keys = set()


def _refresh_hook(ref: weakref.ref[FsdpParameters], state: Any) -> Callable[..., None]:
    state_ref = weakref.ref(state)

    def hook(module: torch.nn.Module, args: Any) -> None:
        params, fsdp_state = ref(), state_ref()
        if params is not None and fsdp_state is not None and not torch.compiler.is_compiling():
            params.add_state(fsdp_state)

    return hook
