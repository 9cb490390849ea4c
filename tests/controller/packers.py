"""A :class:`Packer` outside any controller, for tests of the pack and unpack hooks."""

from __future__ import annotations

from memctl.controller.config import ControllerConfig
from memctl.controller.hooks import ModuleTracker
from memctl.controller.packing import Packer


def strict_packer(config: ControllerConfig) -> Packer:
    """A packer inside a model's forward (so tensors are compressed, not kept exact), every
    layer at 2 bits, that fails the test on any codec fallback instead of hiding it."""
    tracker = ModuleTracker()
    tracker.model_depth = 1

    def fail(layer: str, exc: BaseException) -> None:
        raise AssertionError(f"codec fallback in {layer}: {exc}")

    return Packer(config, tracker, lambda layer: (2.0, None), fail)
