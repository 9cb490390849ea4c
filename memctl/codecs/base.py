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
returns, byte for byte, ``decode(p).clamp_min_(floor).mul_(m)`` (``m`` the bit mask of the
values that must come back positive, a lossless record of a bool tensor; ``floor`` is
:func:`mask_floor` of the dtype, NOTE [ Mask floor ]), written in one pass. Such a codec says so with a class
attribute ``decodes_mask = True`` (read through :func:`decodes_mask`); the controller then
hands it the mask instead of applying it after decoding. A codec without the attribute
is decoded plainly and the mask applied afterwards, with the same result.

NOTE [ Mask floor ]
A value that must come back positive but decodes to zero or below (a small positive
value that 2-bit stochastic rounding sent to its group's zero: at 2 bits, a large share
of a ReLU output's positives) is raised to a floor. The floor was the dtype's smallest
normal number (1.2e-38 in float32); the backward multiplies these values by gradients
(the next layer's weight gradient reads the same record), and every such product is a
subnormal float, which x86 CPUs compute through a microcode assist tens of times slower
than a normal multiply: on a 3-layer MLP the backward took 4x as long as plain PyTorch's.
The floor is therefore ``2**-64`` (5.4e-20), whose products with any value of magnitude
above ``2**-62`` stay normal, or the dtype's smallest normal number where that is larger
(float16: ``2**-14``). Against the quantisation step of any group it is nothing, and
the region test the backward makes (``> 0``, or beyond any boundary at zero) is the same.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

__all__ = ["FLOAT_DTYPES", "MASK_FLOOR", "Codec", "Impl", "Packed", "decodes_mask", "mask_floor"]

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
#: Least magnitude of a value kept on the positive (or negative) side of a boundary at zero
#: (NOTE [ Mask floor ]): products with it stay normal floats.
MASK_FLOOR = 2.0**-64


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
        total = 0
        for b in self.buffers.values():
            total += b.numel() * b.element_size()
        return total

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


def mask_floor(dtype: torch.dtype) -> float:
    """The least positive value a masked decode or a region projection writes (NOTE [ Mask floor ])."""
    return max(MASK_FLOOR, float(torch.finfo(dtype).tiny))
