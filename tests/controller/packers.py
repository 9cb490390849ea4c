"""A :class:`Packer` outside any controller, for tests of the pack and unpack hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from memctl.controller import packing
from memctl.controller.config import ControllerConfig
from memctl.controller.hooks import ModuleTracker
from memctl.controller.packing import Packer, _Queued


def strict_packer(config: ControllerConfig, queue: bool = False) -> Packer:
    """A packer inside a model's forward (so tensors are compressed, not kept exact), every
    layer at 2 bits, that fails the test on any codec fallback instead of hiding it. ``queue``:
    small tensors wait in the queue (NOTE [ Packs queued in the forward ]); off, so that the
    record :meth:`Packer.pack` returns is the tensor's own (the queue's own tests turn it on)."""
    tracker = ModuleTracker()
    tracker.model_depth = 1

    def fail(layer: str, exc: BaseException) -> None:
        raise AssertionError(f"codec fallback in {layer}: {exc}")

    return Packer(config, tracker, lambda layer: (2.0, None), fail, queue=queue)


def activation_step(
    packer: Packer, x: torch.Tensor, w: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
    finish: bool = True,
) -> list[tuple[Any, torch.Tensor]]:
    """One forward and backward of ``linear(act(x * 2 + 1), w)`` through ``packer``, and the step
    boundary if ``finish``: each record with the tensor it was packed from (the activation's
    input has an ``AddBackward0``)."""
    records: list[tuple[Any, torch.Tensor]] = []

    def pack(t: torch.Tensor) -> Any:
        saved = packer.pack(t)
        records.append((saved, t))
        return saved

    packer.begin_forward(int(x.shape[0]))
    with torch.autograd.graph.saved_tensors_hooks(pack, packer.unpack):
        y = F.linear(act(x * 2.0 + 1.0), w)
    y.sum().backward()
    if finish:
        packer.finish_step()
    return records


def record_of(handle: Any) -> Any:
    """What a pack hook's return stands for once packed: a queued tensor's record (NOTE [ Packs
    queued in the forward ]), anything else itself."""
    return handle.saved if isinstance(handle, _Queued) else handle


def spy_records(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Every record the pack hook makes from now on, with the saved tensor's grad_fn name."""
    out: list[tuple[str, Any]] = []
    pack_new = packing.Packer._pack_new

    def spy(self: packing.Packer, t: torch.Tensor, layer: str, *rest: Any) -> Any:
        saved = pack_new(self, t, layer, *rest)
        out.append((type(t.grad_fn).__name__ if t.grad_fn is not None else "", saved))
        return saved

    monkeypatch.setattr(packing.Packer, "_pack_new", spy)
    return out


def eight_bits_beside_plain(model: torch.nn.Module, x: torch.Tensor, **options: Any) -> tuple[Any, Any, Any]:
    """``(plain, optimizer, controller)``: a copy of ``model`` with plain PyTorch's gradient of
    ``model(x).square().mean()``, and ``model`` under a controller at 8 bits everywhere
    (calibration off, every tensor compressed) with a learning rate of 0, for tests that
    compare memctl's gradient with plain's."""
    import copy

    import memctl

    plain = copy.deepcopy(model)
    plain(x).square().mean().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=8.0, bit_choices=(8,), calibration_fraction=0.0,
                            monitor_interval_s=0, min_numel=0, **options)
    return plain, opt, ctl


def records_of(ctl: Any, keep: Callable[[torch.Tensor], bool]) -> list[Any]:
    """A list that receives what ``ctl``'s pack hook returns for every tensor ``keep`` picks,
    from now on (a queued pack's handle: :func:`record_of` gives its record)."""
    found: list[Any] = []
    pack = ctl._packer.pack

    def recording(t: torch.Tensor) -> Any:
        saved = pack(t)
        if keep(t):
            found.append(saved)
        return saved

    ctl._packer.pack = recording
    ctl._scope._pack = recording
    return found
