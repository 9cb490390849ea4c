"""A counter-based 32-bit hash that gives the same random bits in PyTorch, Numba CPU and Numba CUDA.

NOTE [ Counter-based RNG ]
Stochastic rounding needs one random number per value, and the three implementations
of a codec must draw the same ones. A stateful generator cannot do that across a CPU
loop, a parallel CPU kernel and thousands of GPU threads, so the random bits are a pure
function of ``(seed, index)``, where ``index`` is the value's position in the flattened
tensor. The mixing function is ``lowbias32`` (Chris Wellons, "Prospecting for hash
functions", 2018), a 32-bit integer finaliser with low bias::

    lowbias32(x): x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16
                  (all mod 2**32)

and the hash of position ``index`` under ``seed`` is::

    key(seed, hi) = lowbias32(seed ^ (hi * 0x9E3779B9 mod 2**32))
    hash(seed, index) = lowbias32((index mod 2**32) ^ key(seed, index >> 32))

``key`` is the same for all indices below 2**32 (and for every run of 2**32 after), so
the kernels compute it once per group and spend one ``lowbias32`` per value. Every
implementation works on unsigned 64-bit (PyTorch: signed 64-bit) integers holding
32-bit values and masks after each multiplication, so no arithmetic overflows (in the
CUDA simulator, NumPy's 32-bit scalars would warn on overflow).
See docs/formats.md, "Random bits".
"""

from __future__ import annotations

import numpy as np
import torch

from memctl.errors import CodecError

__all__ = [
    "GOLDEN32",
    "MASK32",
    "SEED_LIMIT",
    "check_seed",
    "hash_torch",
    "key_int",
    "lowbias32_int",
    "lowbias32_numba",
    "lowbias32_torch",
]

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9
SEED_LIMIT = 1 << 32
_M1 = 0x7FEB352D
_M2 = 0x846CA68B


def check_seed(seed: object) -> int:
    """``seed`` as an int in ``[0, 2**32)``; a :class:`CodecError` naming it otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise CodecError(f"seed={seed!r} must be an int in [0, 2**32); pass e.g. seed=0")
    value = int(seed)
    if not 0 <= value < SEED_LIMIT:
        raise CodecError(f"seed={value} is outside [0, 2**32); reduce it, e.g. seed % 2**32")
    return value


def lowbias32_int(x: int) -> int:
    """``lowbias32`` on a Python int (only its low 32 bits are used)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    x ^= x >> 16
    return x


def key_int(seed: int, hi: int) -> int:
    """The per-2**32-block key of NOTE [ Counter-based RNG ] as a Python int."""
    return lowbias32_int(seed ^ ((hi * GOLDEN32) & MASK32))


def lowbias32_numba(x: np.uint64) -> np.uint64:
    """``lowbias32`` on a ``uint64`` holding a 32-bit value; compiled by Numba (CPU and CUDA).

    Also runs as plain Python on NumPy scalars, which is what the CUDA simulator does.
    """
    m = np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & m
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & m
    x = x ^ (x >> np.uint64(16))
    return x


def _mul32_torch(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 tensors holding 32-bit values, without int64 overflow."""
    lo = (x * (c & 0xFFFF)) & MASK32
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def lowbias32_torch(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` elementwise on an int64 tensor of 32-bit values."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32_torch(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32_torch(x, _M2)
    return x ^ (x >> 16)


def hash_torch(seed: int, index: torch.Tensor) -> torch.Tensor:
    """``hash(seed, index)`` of NOTE [ Counter-based RNG ] for an int64 tensor of positions."""
    hi = index >> 32
    key = lowbias32_torch(_mul32_torch(hi, GOLDEN32) ^ seed)
    return lowbias32_torch((index & MASK32) ^ key)
