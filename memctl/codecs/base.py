"""The codec contract: :class:`Packed` records, :class:`Codec` and the implementation choice.

NOTE [ Codec contract ]
A codec turns a tensor into a :class:`Packed` record and back. For every codec,
``decode(encode(t))`` has ``t``'s shape, dtype and device; what else holds (exactness,
an error bound, unbiasedness) is the codec's own promise, written in its docstring.
Every record's buffers live on the input's device; ``Packed.nbytes`` is the sum of
their real sizes, so the byte counts the controller reports are measured, not modelled.
Each codec has three implementations (:class:`Impl`) that write byte-identical buffers
for the same input, arguments and seed.
Every codec's record format, buffer by buffer: docs/formats.md, "Packed records".

NOTE [ Masks in decode ]
A codec may apply a ReLU region code while it decodes: its ``decode(p, mask=m)`` then
returns, byte for byte, ``decode(p).clamp_min_(tiny).mul_(m)`` (``m`` the bit mask of the
values that must come back positive, a lossless record of a bool tensor; ``tiny`` the
dtype's smallest normal number), written in one pass. Such a codec says so with a class
attribute ``decodes_mask = True`` (read through :func:`decodes_mask`); the controller then
hands it the mask instead of applying it after decoding. A codec without the attribute
is decoded plainly and the mask applied afterwards, with the same result.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

__all__ = ["FLOAT_DTYPES", "Codec", "Impl", "Packed", "decodes_mask"]

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


class Impl(str, enum.Enum):
    """Which implementation runs a codec.

    ``REFERENCE`` is readable PyTorch that always works (on any device); ``CPU`` is a
    Numba ``@njit(parallel=True)`` kernel; ``CUDA`` is a Numba-CUDA kernel on PyTorch's
    current stream. ``None`` where an ``impl`` is accepted means: CUDA for a CUDA tensor,
    CPU for a CPU tensor.
    """

    REFERENCE = "reference"
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True, eq=False)
class Packed:
    """A compressed tensor.

    Attributes:
        codec: name of the codec that wrote it (``memctl.codecs.get(codec)`` decodes it).
        shape, dtype, device: those of the original tensor.
        buffers: the record's data, every tensor on ``device``; the payload and metadata.
        params: the small scalars decoding needs (bits, group size, bound, ...).
    """

    codec: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    buffers: Mapping[str, torch.Tensor]
    params: Mapping[str, int | float | str] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Exact bytes held by the record's buffers (payload plus metadata)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the original tensor."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def ratio(self) -> float:
        """Compression ratio, original bytes over record bytes (``inf`` for an empty record)."""
        return self.raw_nbytes / self.nbytes if self.nbytes else float("inf")

    def to_bytes(self) -> bytes:
        """All buffers, in name order, as one byte string (for comparing implementations)."""
        parts = []
        for name in sorted(self.buffers):
            b = self.buffers[name].detach().contiguous().cpu()
            parts.append(b.reshape(-1).view(torch.uint8).numpy().tobytes())
        return b"".join(parts)


@runtime_checkable
class Codec(Protocol):
    """What every codec provides; see NOTE [ Codec contract ]."""

    name: str

    def encode(
        self,
        t: torch.Tensor,
        *,
        bits: int | None = None,
        error_bound: float | None = None,
        seed: int = 0,
        impl: Impl | str | None = None,
    ) -> Packed: ...

    def decode(self, p: Packed, *, impl: Impl | str | None = None) -> torch.Tensor: ...


def decodes_mask(codec: object) -> bool:
    """Whether ``codec``'s ``decode`` takes a ReLU mask (NOTE [ Masks in decode ])."""
    return getattr(codec, "decodes_mask", False) is True
