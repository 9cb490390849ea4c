"""Per-micro-batch accounting of what one step saved.

NOTE [ Micro-batches ]
With gradient accumulation a step runs several forward/backward pairs before the
optimizer step. What is held at once is one micro-batch's saved tensors (autograd frees
them during its backward), not their sum, so the budget and the batch size must be
judged per micro-batch. Every top-level forward of the model starts a
:class:`MicroBatch`: the records of what it saved, the samples it was given, weak
references to its live saved records, whether backward read them (``used``) and which
earlier micro-batches of the step were still alive when it started (``overlaps``: two
forwards before one backward hold both). At the step boundary :func:`peak_basis` takes
the micro-batches whose records backward read (a validation forward under grad, or a
forward that raised, is never read and does not count), and picks the one which, with
the used micro-batches alive beside it, held the most bytes: the step's peak. Its
records (merged with those beside it) are what the statistics and the allocation see,
and its samples are the step's batch size (samples per forward).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, TypeVar

from memctl.controller.stats import LayerStep

__all__ = ["MicroBatch", "Peak", "peak_basis"]

_T = TypeVar("_T")


class MicroBatch:
    """What one forward of the model saved (see NOTE [ Micro-batches ])."""

    __slots__ = ("_discard", "overlaps", "records", "refs", "samples", "used")

    def __init__(self, overlaps: list[MicroBatch] | None = None) -> None:
        self.records: dict[str, LayerStep] = {}
        self.samples = 0
        self.refs: set[weakref.ref[Any]] = set()
        # One callback object for all of this micro-batch's references, not one bound method
        # per saved record (each would stay alive, and be traversed by the collector, all step).
        self._discard = self.refs.discard
        self.used = False
        self.overlaps: list[MicroBatch] = overlaps or []

    @property
    def live(self) -> bool:
        """True while autograd still holds one of the records this micro-batch saved."""
        return bool(self.refs)

    @property
    def empty(self) -> bool:
        return not self.records and not self.samples

    def track(self, saved: _T) -> weakref.ref[_T]:
        """Count ``saved`` as live until autograd (or the user) drops it; returns the weak
        reference, which the de-duplication table shares (one per record)."""
        ref = weakref.ref(saved, self._discard)
        self.refs.add(ref)
        return ref

    def nbytes(self) -> int:
        return sum(r.packed_bytes + r.other_bytes for r in self.records.values())


@dataclasses.dataclass(frozen=True)
class Peak:
    """The step's accounting basis: records and samples of its peak micro-batch."""

    records: dict[str, LayerStep]
    samples: int
    micro_batches: int


def peak_basis(batches: list[MicroBatch]) -> Peak:
    """The peak of NOTE [ Micro-batches ] over one step's micro-batches."""
    batches = [b for b in batches if not b.empty]
    used = [b for b in batches if b.used]
    # No backward at all (an optimizer step on gradients from elsewhere): judge every forward.
    pool = used or batches
    if not pool:
        return Peak({}, 0, 0)
    members = {id(b) for b in pool}
    best: list[MicroBatch] = []
    best_bytes = -1
    for b in pool:
        group = [b, *(o for o in b.overlaps if id(o) in members)]
        nbytes = sum(g.nbytes() for g in group)
        if nbytes > best_bytes:
            best, best_bytes = group, nbytes
    if len(best) == 1:
        return Peak(best[0].records, best[0].samples, len(pool))
    merged: dict[str, LayerStep] = {}
    for b in best:
        for name, rec in b.records.items():
            merged[name] = _merge(merged[name], rec) if name in merged else rec
    return Peak(merged, sum(b.samples for b in best), len(pool))


def _merge(a: LayerStep, b: LayerStep) -> LayerStep:
    out = LayerStep()
    for f in dataclasses.fields(LayerStep):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "element_size":
            value: Any = max(x, y)
        elif isinstance(x, list):
            value = [*x, *y]
        else:
            value = x + y
        setattr(out, f.name, value)
    return out
