"""One decode for the several backward nodes that read the same saved tensor: :class:`SharedDecode`.

NOTE [ One decode for several readers ]
A tensor that several ops save (a ReLU output is saved by the ReLU, for its mask, and by the
convolution or linear layer that reads it) is packed once: the pack hook hands every saver
the same record (the dedup table of :class:`~memctl.controller.packing.Packer`), which counts
its savers in ``Saved.readers``. Without more, backward decodes that record once per saver,
and the decode (a full pass writing a tensor of the original size) is then paid two or three
times. The packer therefore keeps the last decoded tensor of a record that still has readers
to come, and hands it to the next of them instead of decoding again, until the last one has
read it. Plain PyTorch gives all the savers the same tensor too, and autograd never modifies
an unpacked tensor in place (it wraps it in a new variable for each node), so sharing it
changes no value.

Only one decoded tensor is held at a time: a record whose readers are far apart in the
backward (another record with readers to come is decoded in between) is decoded again for
the later ones, so the memory held beyond plain decoding is bounded by one decoded tensor.
In the common case the readers are neighbours in the backward (the ReLU node and the layer
after it), and the tensor is held only from one node to the next. The record is held by a
weak reference: a record autograd has dropped releases the tensor with it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["SharedDecode"]


class SharedDecode:
    """The last decoded tensor of a record with readers to come (NOTE [ One decode for several readers ]).

    The record and its tensor are one tuple, replaced whole, so that a backward running in
    several threads (one per device) never pairs a record with another record's tensor.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: tuple[weakref.ref[Any], torch.Tensor] | None = None

    @property
    def held(self) -> torch.Tensor | None:
        """The tensor held now, if any."""
        held = self._held
        return None if held is None else held[1]

    def take(self, saved: Any) -> torch.Tensor | None:
        """Count one read of ``saved``; the tensor an earlier reader decoded, or None."""
        saved.readers -= 1
        last = saved.readers <= 0
        held = self._held
        if held is None or held[0]() is not saved:
            return None
        if last and self._held is held:
            self._held = None
        return held[1]

    def keep(self, saved: Any, out: torch.Tensor) -> None:
        """Hold ``out``, just decoded from ``saved``, when more readers of it are to come."""
        if saved.readers > 0:
            self._held = (weakref.ref(saved, self._dropped), out)

    def _dropped(self, ref: weakref.ref[Any]) -> None:
        held = self._held
        if held is not None and held[0] is ref:
            self._held = None

    def clear(self) -> None:
        self._held = None
