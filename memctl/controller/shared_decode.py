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

The held tensors are bounded: the last one decoded, whatever its size, and at most
:data:`OLDER` older ones while they come to at most :data:`OLDER_BYTES` together; the
oldest goes first. A record whose readers are further apart in the backward than that is
decoded again for the later ones, so the memory held beyond plain decoding is one decoded
tensor plus 1 MiB. In the common case the readers are neighbours in the backward (the
ReLU node and the layer after it), and the tensor is held only from one node to the next.
A recurrent net's step is the other common case: a GRU's hidden state is read by its own
step's gates and by the next step's matrix products, with a few small records decoded in
between (2-layer GRU of ``benchmarks/training.py``: 96 of 676 decodes a step were second
decodes of a record when one tensor was held, none with four 16 KiB ones). Each record is
held by a weak reference: a record autograd has dropped releases its tensor with it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["OLDER", "OLDER_BYTES", "SharedDecode"]


#: Older decoded tensors held besides the last one, and their total size.
OLDER = 4
OLDER_BYTES = 1 << 20


class SharedDecode:
    """Decoded tensors of records with readers to come (NOTE [ One decode for several readers ]).

    The entries are one tuple of ``(record reference, tensor)`` pairs, newest first, replaced
    whole, so that a backward running in several threads (one per device) never pairs a
    record with another record's tensor.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: tuple[tuple[weakref.ref[Any], torch.Tensor], ...] = ()

    @property
    def held(self) -> torch.Tensor | None:
        """The tensor decoded last among those held, if any."""
        held = self._held
        return held[0][1] if held else None

    def holds(self, saved: Any) -> bool:
        """Whether a decoded tensor of ``saved`` is held (nothing counted)."""
        return any(ref() is saved for ref, _ in self._held)

    def take(self, saved: Any) -> torch.Tensor | None:
        """Count one read of ``saved``; the tensor an earlier reader decoded, or None."""
        saved.readers -= 1
        last = saved.readers <= 0
        held = self._held
        for i, (ref, tensor) in enumerate(held):
            if ref() is saved:
                if last:
                    self._held = held[:i] + held[i + 1:]
                return tensor
        return None

    def keep(self, saved: Any, out: torch.Tensor) -> None:
        """Hold ``out``, just decoded from ``saved``, when more readers of it are to come."""
        if saved.readers <= 0:
            return
        older: list[tuple[weakref.ref[Any], torch.Tensor]] = []
        total = 0
        for entry in self._held[:OLDER]:
            total += entry[1].numel() * entry[1].element_size()
            if total > OLDER_BYTES:
                break
            older.append(entry)
        self._held = ((weakref.ref(saved, self._dropped), out), *older)

    def _dropped(self, ref: weakref.ref[Any]) -> None:
        self._held = tuple(entry for entry in self._held if entry[0] is not ref)

    def clear(self) -> None:
        self._held = ()
