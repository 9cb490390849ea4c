"""Graph walks for table ops, stopped in models that have none.

NOTE [ Walks that find nothing ]
Two walks run for every compressed record: the region tracker's, for a piecewise or smooth
activation that saved an earlier input (NOTE [ Finding the op that saved a tensor ] in
regions.py), and the floor tracker's, for an attention or a norm that did (NOTE [ Bit
floors ] in floors.py). They cost the most where they find nothing: a GRU packs ~900 small
tensors a step, has no table op either walk looks for, and the two walks took ~25 ms of
its ~100 ms step (one thread, benchmarks/training.py's GRU; the floor walk ~10-13 ms of it,
measured as the step with the floors on against off). So each tracker counts the forwards
in which its walks found nothing while it packed something (:class:`QuietWalks`). After
:data:`QUIET_FORWARDS` such forwards in a row, a pack walks no further than the tensor's
own node, looking through reshapes (a linear layer saves a 2-D view of a 3-D input; the
floor tracker: not at all, and it keeps no records for a walk to find),
except in every :data:`RECHECK`-th quiet forward, which walks in full. Anything found
turns the full walks back on at once:

- the floor tracker: a packed tensor that is an attention's or softmax's result or a
  norm's output (:meth:`~memctl.controller.floors.FloorTracker.result_floor`, which
  walks nothing and runs for every compressed record), or a full walk's find;
- the region tracker: a table op at the tensor's own node (the first node a walk visits)
  or a full walk's find. At that node it also still releases the pending inputs an op
  outside the table consumed (NOTE [ Releasing inputs early ]); an input consumed
  further up stays in the window of :data:`~memctl.controller.regions.PENDING` until
  newer inputs push it out.

The packer's checks for a record it can keep as derived from others (NOTE [ Outputs
recomputed from the input ] in derived.py, NOTE [ Batch-norm outputs recomputed from the
input ] in normalized.py, NOTE [ Elementwise expressions ] in expressions.py) are walks of
the same kind, and stop the same way (``Packer._derivations``): on the GRU they ran for
every one of its ~580 compressed records a step and found none. They still run whenever
an op's output or a module's expression is on offer in the forward (something found them
one), and a find turns them back on at once. What a model that starts to have such records
loses meanwhile is memory, never a value: the record is compressed at its layer's bits.

A calibration replay (NOTE [ Replay ] in replay.py) runs the step's forward again in a
packer of its own, which would walk in full: it takes training's state instead
(``Packer.walking``), since the same model on the same inputs finds what training found.
A GRU's replays, each a forward and backward, took ~10% less time (one thread, ~100 ms
each before).

A model whose forward starts using a table op after it was counted quiet may lose, until
one of these finds it (at most :data:`RECHECK` forwards), the region codes or floors of
the op's inputs: those keep their layer's bits, the path of an unmatched input, never a
wrong value. A forward that packs nothing (evaluation under ``no_grad``) does not count.
"""

from __future__ import annotations

__all__ = ["QUIET_FORWARDS", "RECHECK", "QuietWalks"]

QUIET_FORWARDS = 2
"""Forwards in a row whose walks found nothing, after which the walks stop."""
RECHECK = 16
"""Every this many quiet forwards, one walks in full."""


class QuietWalks:
    """Whether a tracker's walks run in full in this forward (NOTE [ Walks that find nothing ])."""

    __slots__ = ("_found", "_packed", "_quiet", "walking")

    def __init__(self) -> None:
        self._quiet = 0
        """Forwards in a row in which the walks found nothing."""
        self._found = False
        self._packed = False
        self.walking = True

    def packed(self) -> None:
        """A record was offered to the tracker in this forward."""
        self._packed = True

    def found(self) -> None:
        """The tracker found a table op: walk in full from here on."""
        self._found, self._quiet, self.walking = True, 0, True

    def begin_forward(self) -> None:
        """Count the forward that ended and decide for the one that starts."""
        if self._found:
            self._quiet = 0
        elif self._packed:
            self._quiet += 1
        self._found = self._packed = False
        self.walking = self._quiet < QUIET_FORWARDS or self._quiet % RECHECK == 0
