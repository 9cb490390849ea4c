"""Small records encoded together: :class:`Batches`.

NOTE [ Batched small records ]
A recurrent net saves many small tensors: the 2-layer GRU of ``benchmarks/training.py``
saves ~870 a step, ~580 of them compressed, of 4,096-12,288 values each. Encoded one by
one, each costs a codec call (~24 µs at one thread, of which ~7 µs is the kernel's work;
the rest is argument checks, three allocations and the launch), so the codec alone was
about the whole step time that issue's target allows memctl on that model.

So a float tensor the quantize codec would encode on the CPU, with fewer than
:data:`BATCH_BELOW` values (those its kernel runs serially anyway), a whole number of
quantisation groups and no region code, joins a batch of its bits and dtype instead:
- at pack time it gets its record at once (a :class:`BatchRecord`, a
  :class:`~memctl.codecs.base.Packed` whose payload and group metadata are slices of the
  batch's buffers, made when read), so the record's size, its bits and every field but the
  bytes are right from the start; the record holds the tensor until the batch is encoded;
- the batch is encoded in one call (``QuantizeCodec.encode_into`` on the members' values
  concatenated, group-aligned, so every member's groups are its own) when it holds
  :data:`BATCH_VALUES` values, when the model's forward ends, before a lossy record is
  decoded, and at the step boundary; a batch encoded before it is full moves its bytes to
  a payload of the size used, so no record holds more than a batch's unused tail.
A record is one object with a few attributes: no dictionary, no view tensors, no member
object beside it, its size computed, and the range statistics of a layer's consecutive
records in a batch kept as one run of the batch's groups (NOTE [ Range statistics ] in
packing.py). The first version made two views, a dictionary and a member per record:
~7 µs a record more in the pack hook and a third more objects for the garbage collector
to walk (the GRU below: 47.1 -> 40.4 µs a saved tensor in the pack hook, and the young
collections 2.2 -> 1.2 ms a step).
Until then a record's bytes are not written: nothing reads them before a decode, and the
unpack hook encodes the pending batches before it decodes anything (a node's exact field
read in the forward, a batch norm's mean, does not wait for them). The few paths that
store a record again (a bit floor, a root raised for a derived record) replace its data;
the batch then skips it, and a batch whose records were all stored again is not encoded:
one pass over its values keeps the group ranges the statistics read.
A member changed in place before its batch is encoded keeps its changed values exact, and
the unpack hook raises autograd's in-place error for it, as PyTorch does (NOTE [ In-place
checks ]); a batch whose encode fails keeps its members exact (NOTE [ Codec fallback ]).
The tensors held wait at most one batch (1 MiB of float32 per bits and dtype) longer than
one by one. Stochastic rounding draws per value from the batch's seed and the value's place
in the batch, as it would in one record.

Backward reads the records in about the reverse order of the forward, so a batch's records
are read close together: the unpack hook decodes a batch whole on the first read of one of
its records (without a region code or a non-finite value; those are decoded alone, as any
record), splits that tensor into every record's piece in one call (a slice and a view a
record from Python cost ~a third of the unpack hook) and hands the others their pieces,
holding the two batches decoded last
(at most 2 MiB beyond decoding one by one; two, because a recurrent net's backward
alternates between its layers' batches: with one held, the GRU above decoded 24 batches a
step instead of 12). The decode timings (``stats()["timings"]["decode"]``) observe a batch's
decode once, not each of its records' pieces. On the GRU above: 12 encodes and 12 decodes
a step instead of 580 of each, the codec kernels 19.4 -> 4.9 ms and memctl's CPU time
beyond plain's 66.9 -> 55.1 ms a step (``benchmarks/overhead.py``, benchmarks/README.md);
the rest of its cost is per record in Python, not the codec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from memctl.codecs.base import Packed
from memctl.codecs.quantize.codec import group_at

__all__ = ["BATCH_BELOW", "BATCH_VALUES", "DEFER_PACKS", "Batch", "BatchRecord", "Batches"]

BATCH_BELOW = 1 << 16
"""Records with fewer values join a batch (the quantize kernel's serial size)."""
BATCH_VALUES = 1 << 18
"""Values a batch holds before it is encoded (1 MiB of float32)."""
DEFER_PACKS = 4
"""Packs a deferred record waits for the record that stores it again (NOTE [ Roots known from
the last forward ] in packing.py)."""


class BatchRecord(Packed):
    """A quantize record of a batch (NOTE [ Batched small records ]), decoded alone like any
    other or sliced from its batch decoded whole.

    It is also the batch's member: until the batch is encoded it holds the tensor and where
    its bytes are counted. Its buffers are views of the batch's, made when read (a decode
    alone, a caller reading ``buffers``), not at pack time: a record is a few attributes, not
    a dictionary and two tensors, for each of the hundreds of small tensors a recurrent net
    saves a step (NOTE [ Pack path cost ] in packing.py)."""

    __slots__ = ("batch", "exc", "index", "layer", "numel", "rec", "saved", "source", "start", "version")
    __setattr__ = object.__setattr__  # its own fields change as the batch is encoded (Packed's do not)
    codec = "quantize"

    def __init__(self, batch: Batch, index: int, start: int, source: torch.Tensor, rec: Any,
                 layer: str) -> None:
        object.__setattr__(self, "shape", tuple(source.shape))  # Packed's fields, set once
        object.__setattr__(self, "dtype", source.dtype)
        object.__setattr__(self, "device", source.device)
        self.batch = batch
        self.index = index
        """Its place among the batch's records (its piece of the batch decoded whole)."""
        self.start = start
        """Its first value's place in the batch."""
        object.__setattr__(self, "numel", source.numel())  # (Packed computes it from the shape at every read)
        self.exc: tuple[torch.Tensor, torch.Tensor] | None = None
        """Its non-finite values' places and values, if it has any (set by the encode)."""
        self.source: torch.Tensor | None = source
        """The tensor, held until the batch is encoded."""
        self.version = source._version
        self.rec = rec
        self.layer = layer
        self.saved: Any = None
        """The record the pack hook returned, until the batch is encoded (it holds this one)."""

    @property
    def params(self) -> Mapping[str, int | float | str]:
        return self.batch.params

    @property
    def groups(self) -> tuple[int, int]:
        """Its first group in the batch, and the one after its last."""
        group = self.batch.group
        return self.start // group, -(-(self.start + self.numel) // group)

    @property
    def buffers(self) -> Mapping[str, torch.Tensor]:
        b = self.batch
        g0, g1 = self.groups
        per_group = b.group * b.bits // 8
        exc = self.exc if self.exc is not None else b.empty
        return {"payload": b.payload[g0 * per_group:g1 * per_group], "meta": b.meta[g0:g1],
                "exc_index": exc[0], "exc_value": exc[1]}

    @property
    def nbytes(self) -> int:
        """Its groups' payload and (min, max) metadata, and its exceptions (as ``Packed.nbytes``)."""
        b = self.batch
        g0, g1 = self.groups
        n = (g1 - g0) * (b.group * b.bits // 8 + 8)
        if self.exc is not None:
            n += self.exc[0].nbytes + self.exc[1].nbytes
        return n

    @property
    def live(self) -> bool:
        """Whether its record still holds this batch's bytes (not stored again since)."""
        return self.saved is not None and self.saved.data is self


class Batch:
    """Records of one bits and dtype whose bytes are written by one encode."""

    __slots__ = ("bits", "capacity", "dtype", "empty", "group", "members", "merged", "meta", "packed_at",
                 "params", "payload", "sizes", "squares", "values")

    def __init__(self, bits: int, dtype: torch.dtype, group: int, seed: int,
                 empty: tuple[torch.Tensor, torch.Tensor], capacity: int = BATCH_VALUES) -> None:
        self.bits = bits
        self.dtype = dtype
        self.group = group_at(bits, group)
        """Values per group of its records: the codec's (``group`` configured; NOTE [ Eight-bit
        groups ] in the quantize codec)."""
        self.merged = group // self.group
        """Its groups per group of the configured size, which the range statistics merge (NOTE [
        Range statistics ] in packing.py)."""
        self.capacity = capacity
        """Values it can hold: :data:`BATCH_VALUES`, or one record's groups (a deferred record)."""
        self.payload = torch.empty(capacity * bits // 8, dtype=torch.uint8)
        self.meta = torch.empty((capacity // self.group, 2), dtype=torch.float32)
        """Every group's (min, max), at its capacity's size all its life: the range statistics
        keep slices of it (NOTE [ Range statistics ] in packing.py)."""
        self.params = {"bits": bits, "group_size": self.group, "seed": seed}
        """Shared by the members' records (the same for all; never modified)."""
        self.empty = empty
        """The shared empty exception buffers of the records without non-finite values."""
        self.values = 0
        self.members: list[BatchRecord] = []
        """Its records, until it is encoded."""
        self.sizes: list[int] = []
        """Every record's values, in order (the batch decoded whole is split by them)."""
        self.packed_at = 0
        """The packer's pack count when its first record joined (for a deferred record)."""
        self.squares: dict[int, float] = {}
        """Its records that a tanh or sigmoid saved, by index, with their parabola's vertex: their
        own backward reads them squared (NOTE [ Squares of a rounded result ] in squares.py),
        for all of them at once."""

    def fits(self, numel: int) -> bool:
        return self.values + numel <= self.capacity

    @property
    def groups(self) -> int:
        """Groups its records fill (the last one's may be partial only in a deferred record)."""
        return -(-self.values // self.group)

    def add(self, t: torch.Tensor, rec: Any, layer: str) -> BatchRecord:
        """A record of ``t`` (its bytes written by the encode)."""
        start = self.values
        packed = BatchRecord(self, len(self.sizes), start, t, rec, layer)
        self.members.append(packed)
        self.sizes.append(packed.numel)
        self.values = start + packed.numel
        return packed

    def whole(self) -> Packed:
        """One record of every value the batch holds (after its encode)."""
        return Packed(codec="quantize", shape=(self.values,), dtype=torch.float32, device=self.payload.device,
                      buffers={"payload": self.payload, "meta": self.meta[:self.groups],
                               "exc_index": self.empty[0], "exc_value": self.empty[1]},
                      params=self.params)

    def shrink(self) -> None:
        """Move the bytes written to a payload of the size used (the records' views follow: they
        are made when read). The metadata stays, at most 8 bytes a group unused."""
        used = self.groups
        if used == self.capacity // self.group:
            return
        self.payload = self.payload[:used * self.group * self.bits // 8].clone()


class Batches:
    """The batches still to encode, by bits and dtype (NOTE [ Batched small records ])."""

    def __init__(self, group: int, empty: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.group = group
        self._empty = empty
        self.open: dict[tuple[int, torch.dtype], Batch] = {}
        self.deferred: list[Batch] = []
        """Records encoded alone, later (NOTE [ Roots known from the last forward ] in packing.py)."""

    def __bool__(self) -> bool:
        return bool(self.open) or bool(self.deferred)

    def accepts(self, t: torch.Tensor, numel: int) -> bool:
        """Whether ``t`` (a float tensor without a region code, quantised) may join a batch."""
        return numel < BATCH_BELOW and numel % self.group == 0 and t.is_cpu

    def full(self, bits: int, dtype: torch.dtype, numel: int) -> Batch | None:
        """The open batch ``numel`` more values of ``bits`` and ``dtype`` would overflow, if any."""
        batch = self.open.get((bits, dtype))
        return batch if batch is not None and not batch.fits(numel) else None

    def add(self, t: torch.Tensor, bits: int, seed: int, rec: Any, layer: str) -> BatchRecord:
        key = (bits, t.dtype)
        batch = self.open.get(key)
        if batch is None:
            batch = self.open[key] = Batch(bits, t.dtype, self.group, seed, self._empty())
        return batch.add(t, rec, layer)

    def defer(self, t: torch.Tensor, bits: int, seed: int, rec: Any, layer: str, packs: int) -> BatchRecord:
        """A record of ``t`` alone, encoded later unless it is stored again first."""
        groups = -(-t.numel() // self.group)
        batch = Batch(bits, t.dtype, self.group, seed, self._empty(), capacity=groups * self.group)
        batch.packed_at = packs
        self.deferred.append(batch)
        return batch.add(t, rec, layer)

    def take(self, batch: Batch | None = None) -> list[Batch]:
        """Remove and return ``batch``, or every open batch."""
        if batch is None:
            taken, self.open = [*self.open.values(), *self.deferred], {}
            self.deferred = []
            return taken
        if self.open.get((batch.bits, batch.dtype)) is batch:
            del self.open[(batch.bits, batch.dtype)]
        else:
            self.deferred.remove(batch)
        return [batch]

    def overdue(self, packs: int) -> list[Batch]:
        """Deferred records packed more than :data:`DEFER_PACKS` packs ago."""
        return [b for b in self.deferred if packs - b.packed_at > DEFER_PACKS]
