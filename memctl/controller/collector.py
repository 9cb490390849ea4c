"""Python's garbage collector paused while a step's records live: :class:`CollectorPause`.

NOTE [ Collector paused while records live ]
Every compressed record is a few Python objects that the garbage collector tracks (its
``Saved``, a batch record, weak references, the autograd node objects the walks touched):
on a recurrent net ~8 per saved tensor, ~7,000 a step, all alive from the forward to the
backward. The young collections that their own allocation triggers during the forward
find them alive and promote them, and promoted objects make the full collections come
(every ~20 steps on a 2-layer GRU, 0.2-0.3 s each over the ~400,000 objects of a process
that imported torch, Numba and SciPy): 7 ms of a 40 ms GRU step, measured with
``gc.callbacks``. None of it finds garbage: every record is freed by its reference count
when the backward has read it.

So automatic collection is paused (``gc.disable()``) from the start of a model's forward
that may save tensors until that forward's backward ends (an autograd engine callback,
queued by the backward's first unpack), the optimizer step's boundary, or ``detach()``.
The records are then born and freed inside the pause, and the young generation's count
is back where it was. Bounds: a forward that starts while still paused (no backward since
the last one: evaluation with gradients on, or several forwards before one backward)
resumes collection and runs unpaused, so a pause never outlives two forwards; only when
the collector was enabled is it paused, and ``gc.collect()`` still runs when called.
``ControllerConfig.pause_collector=False`` leaves the collector alone.
"""

from __future__ import annotations

import gc
import logging

import torch

__all__ = ["CollectorPause"]

_log = logging.getLogger("memctl.controller")


class CollectorPause:
    """Pauses automatic garbage collection over one forward and its backward."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.paused = False
        self.pauses = 0

    def forward(self) -> None:
        """A model forward that may save tensors starts."""
        if not self.enabled:
            return
        if self.paused:  # no backward since the last forward: this one runs unpaused
            self.resume()
            return
        if gc.isenabled():
            gc.disable()
            self.paused = True
            self.pauses += 1

    def backward(self) -> None:
        """The first unpack of a backward: resume when the engine finishes it."""
        if self.paused:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self.resume)
            except RuntimeError:  # not inside the engine after all: resume at once
                self.resume()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            gc.enable()
