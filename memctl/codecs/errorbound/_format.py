"""Constants of the ``errorbound`` format shared by its reference and its kernels.

See NOTE [ errorbound format ] and NOTE [ errorbound arithmetic ] in
:mod:`memctl.codecs.errorbound`. Plain Python only: the kernels read these as
compile-time constants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "EG_CLAMP",
    "FLT_MAX",
    "MAX_BITS",
    "MODE_BITS",
    "MODE_RAW",
    "MODE_SPARSE",
    "Q_LIMIT",
    "STEP_FACTOR",
    "DtypeSpec",
    "dtype_spec",
]

# Layout of the per-group ``mode`` byte.
MODE_BITS = 0x1F  # low five bits: code width b (0..24)
MODE_SPARSE = 0x20  # payload = nonzero bitmap, then the nonzero codes
MODE_RAW = 0x40  # payload = the group's values verbatim, in the input dtype's bits

MAX_BITS = 24  # groups that would need wider codes are stored raw
Q_LIMIT = 2.0**29  # |q| <= 2^29 keeps q * step exact in float64 (29 + 24 <= 53 bits)
STEP_FACTOR = 2.0 - 2.0**-9  # step = 2 * e_g * (1 - 2^-10): slack for rounding
EG_CLAMP = 2.0**126  # larger bounds gain nothing and would overflow the float32 step
FLT_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class DtypeSpec:
    """What the codec needs to know about an input dtype.

    Attributes:
        dtype: the input dtype.
        raw_int: the signed integer dtype of the same width (raw groups store its bits).
        exp_bits, man_bits: exponent and stored-mantissa widths of ``dtype``.
        cast_rel, cast_min: half an ulp of ``dtype`` at magnitude M is at most
            ``max(M * cast_rel, cast_min)``; both 0 for float32 (no final cast).
        shrink: factor < 1 that keeps the rounded ``e - halfulp`` below its exact value.
        vmax: largest finite value of ``dtype``; a decoded float32 above it would
            overflow in the final cast.
    """

    dtype: torch.dtype
    raw_int: torch.dtype
    exp_bits: int
    man_bits: int
    cast_rel: float
    cast_min: float
    shrink: float
    vmax: float

    @property
    def raw_width(self) -> int:
        """Bits per value of a raw group."""
        return 1 + self.exp_bits + self.man_bits


_SPECS: dict[torch.dtype, DtypeSpec] = {
    torch.float32: DtypeSpec(torch.float32, torch.int32, 8, 23, 0.0, 0.0, 1.0, FLT_MAX),
    # float16: 11 significand bits, smallest subnormal 2^-24, largest 65504.
    torch.float16: DtypeSpec(torch.float16, torch.int16, 5, 10, 2.0**-11, 2.0**-25, 1.0 - 2.0**-40, 65504.0),
    # bfloat16: 8 significand bits, smallest subnormal 2^-133, largest (2 - 2^-7) * 2^127.
    torch.bfloat16: DtypeSpec(
        torch.bfloat16, torch.int16, 8, 7, 2.0**-8, 2.0**-134, 1.0 - 2.0**-40, 3.3895313892515355e38
    ),
}


def dtype_spec(dtype: torch.dtype) -> DtypeSpec | None:
    """The spec of a supported input dtype, or None."""
    return _SPECS.get(dtype)
