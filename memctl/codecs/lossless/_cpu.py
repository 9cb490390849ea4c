"""Numba CPU kernels of the ``lossless`` codec: bool masks packed at one bit per value.

Module-level functions compiled with ``cache=True`` (NOTE [ Kernel cache ] in
:mod:`memctl.codecs._numba`); this module imports Numba at its top, so it is imported only
on the codec's first CPU use. The parallel and serial entry points call the same per-range
functions, so they write the same bytes.
"""

from __future__ import annotations

from typing import Any

from numba import prange

from memctl.codecs._numba import cached_jit

__all__ = ["pack", "pack_serial", "two_valued_serial", "unpack", "unpack_serial"]

_CHUNK = 1 << 14  # output bytes per prange iteration


@cached_jit()
def _pack_bytes(bits: Any, out: Any, k0: Any, k1: Any) -> None:
    """Output bytes ``k0 .. k1 - 1`` (whole bytes only: ``8 * k1 <= bits.size``)."""
    for k in range(k0, k1):
        j = 8 * k
        out[k] = (
            bits[j]
            | (bits[j + 1] << 1)
            | (bits[j + 2] << 2)
            | (bits[j + 3] << 3)
            | (bits[j + 4] << 4)
            | (bits[j + 5] << 5)
            | (bits[j + 6] << 6)
            | (bits[j + 7] << 7)
        )


@cached_jit()
def _pack_tail(bits: Any, out: Any) -> None:
    """The last, partial byte (when ``bits.size`` is not a multiple of 8)."""
    n = bits.size
    full = n // 8
    if full < out.size:
        acc = 0
        for i in range(8 * full, n):
            acc |= bits[i] << (i - 8 * full)
        out[full] = acc


@cached_jit()
def _unpack_bytes(payload: Any, out: Any, k0: Any, k1: Any) -> None:
    n = out.size
    for k in range(k0, k1):
        b = payload[k]
        for j in range(min(8, n - 8 * k)):
            out[8 * k + j] = (b >> j) & 1


@cached_jit(parallel=True)
def pack(bits: Any, out: Any) -> None:
    full = bits.size // 8
    nchunks = -(-full // _CHUNK)
    for c in prange(nchunks):
        _pack_bytes(bits, out, c * _CHUNK, min(full, (c + 1) * _CHUNK))
    _pack_tail(bits, out)


@cached_jit()
def pack_serial(bits: Any, out: Any) -> None:
    _pack_bytes(bits, out, 0, bits.size // 8)
    _pack_tail(bits, out)


@cached_jit(parallel=True)
def unpack(payload: Any, out: Any) -> None:
    nbytes = (out.size + 7) // 8
    nchunks = -(-nbytes // _CHUNK)
    for c in prange(nchunks):
        _unpack_bytes(payload, out, c * _CHUNK, min(nbytes, (c + 1) * _CHUNK))


@cached_jit()
def unpack_serial(payload: Any, out: Any) -> None:
    _unpack_bytes(payload, out, 0, (out.size + 7) // 8)


@cached_jit()
def two_valued_serial(x: Any, out: Any, values: Any) -> Any:
    """Whether the bit patterns ``x`` (a float tensor's integer view) take at most two values;
    if so, ``values`` gets them (the first value's, then the other's, or the first's again)
    and ``out`` the bits of ``x != values[0]`` (NOTE [ Two-valued floats ] in the codec module).
    Stops at the first third value, so a tensor that is not two-valued costs a few reads."""
    n = x.size
    a = x[0]
    b = a
    other = False
    for k in range((n + 7) >> 3):
        acc = 0
        for j in range(min(8, n - 8 * k)):
            v = x[8 * k + j]
            if v != a:
                if not other:
                    b = v
                    other = True
                elif v != b:
                    return False
                acc |= 1 << j
        out[k] = acc
    values[0] = a
    values[1] = b
    return True
