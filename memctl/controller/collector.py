"""Python's garbage collector paused while a step's records live: :class:`CollectorPause`.

NOTE [ Collector paused while records live ]
Every compressed record is a few Python objects that the garbage collector tracks (its
``Saved``, a batch record, weak references, the autograd node objects the walks touched):
on a recurrent net ~8 per saved tensor, ~7,000 a step, all alive from the forward to the
backward. The young collections that their own allocation triggers during the forward
find them alive and promote them, and promoted objects make the full collections come
(every 30-60 steps on the 2-layer GRU of ``benchmarks/training.py``, 0.15-0.38 s each over
the ~393,000 objects of a process that imported torch, Numba and SciPy): 3-7 ms of a
40 ms plain step, measured with ``gc.callbacks``. None of it finds garbage: every record
is freed by its reference count when the backward has read it.

So automatic collection is paused (``gc.disable()``) from the start of a model's forward
that may save tensors until that forward's backward ends (an autograd engine callback,
queued by the backward's first unpack), the optimizer step's boundary, or ``detach()``.
The records are then born and freed inside the pause, and the young generation's count
is back where it was. Bounds: a forward that starts while still paused (no backward since
the last one: evaluation with gradients on, or several forwards before one backward)
resumes collection and runs unpaused, so a pause lasts until the next forward at most
(or the step boundary, or ``detach()``); only a collector that was enabled is paused, and
``gc.collect()`` still runs when called. One thing is not told apart: a collector that
the training code itself disables during the pause is enabled again when it ends.
``ControllerConfig.pause_collector=False`` leaves the collector alone.
"""

from __future__ import annotations

import gc

import torch

__all__ = ["CollectorPause"]


class CollectorPause:
    """Pauses automatic garbage collection over one forward and its backward."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.paused = False
        """Whether this object disabled the collector and has not enabled it again."""
        self.pauses = 0
        """Forwards that ran paused."""

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
        """Enable the collector again if this object paused it (any number of calls)."""
        if self.paused:
            self.paused = False
            gc.enable()
