"""Numba CPU kernels of :mod:`memctl.codecs.channels` (NOTE [ Fused channel passes ] there).

Module-level functions compiled with ``cache=True`` (NOTE [ Kernel cache ] in
:mod:`memctl.codecs._numba`); this module imports Numba at its top, so it is imported only on
the first CPU use. The parallel and serial entry points call the same per-range functions,
so they write the same bytes.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import prange

from memctl.codecs._numba import cached_jit


@numba.njit(inline="always")
def _project(y: Any, floor: Any, bit: Any) -> Any:
    """A ReLU result's value under its mask bit: ``max(y, floor)`` (NaN stays NaN) or ``·0``."""
    y = floor if y < floor else y
    return y if bit else y * np.float32(0.0)


@numba.njit(inline="always")
def _inside(v: Any, lo: Any, hi: Any, lo_open: Any, hi_open: Any) -> Any:
    above = v > lo if lo_open else v >= lo
    below = v < hi if hi_open else v <= hi
    return 1 if above and below else 0

__all__ = ["affine", "affine_serial", "interval_bits", "interval_bits_serial"]

_BYTES = 1 << 14  # output bytes per prange iteration of the interval mask


@cached_jit(fastmath=False)
def _affine_blocks(
    x: Any, sub: Any, scale: Any, shift: Any, inner: Any, out: Any, bits: Any, masked: Any, floor: Any,
    k0: Any, k1: Any,
) -> None:
    """Blocks ``k0 .. k1 - 1`` of ``inner`` values each: block ``k`` is channel ``k % C``."""
    channels = sub.size
    for k in range(k0, k1):
        c = k % channels
        a = sub[c]
        s = scale[c]
        h = shift[c]
        start = k * inner
        xs = x[start : start + inner]
        os = out[start : start + inner]
        if not masked:
            for j in range(inner):
                os[j] = (xs[j] - a) * s + h
        elif (start | inner) & 7 == 0:  # whole mask bytes: one load per 8 values
            b0 = start >> 3
            for kb in range(inner >> 3):
                byte = bits[b0 + kb]
                for j in range(8):
                    os[8 * kb + j] = _project((xs[8 * kb + j] - a) * s + h, floor, (byte >> j) & 1)
        else:
            for j in range(inner):
                i = start + j
                os[j] = _project((xs[j] - a) * s + h, floor, (bits[i >> 3] >> (i & 7)) & 1)


@cached_jit(parallel=True, fastmath=False)
def affine(x: Any, sub: Any, scale: Any, shift: Any, inner: Any, out: Any, bits: Any, masked: Any,
           floor: Any, per: Any) -> None:
    blocks = x.size // inner
    nchunks = -(-blocks // per)
    for c in prange(nchunks):
        k1 = min(blocks, (c + 1) * per)
        _affine_blocks(x, sub, scale, shift, inner, out, bits, masked, floor, c * per, k1)


@cached_jit(fastmath=False)
def affine_serial(x: Any, sub: Any, scale: Any, shift: Any, inner: Any, out: Any, bits: Any, masked: Any,
                  floor: Any, per: Any) -> None:
    _affine_blocks(x, sub, scale, shift, inner, out, bits, masked, floor, 0, x.size // inner)


@cached_jit(fastmath=False)
def _interval_bytes(x: Any, lo: Any, hi: Any, lo_open: Any, hi_open: Any, out: Any, k0: Any, k1: Any) -> None:
    """Output bytes ``k0 .. k1 - 1``: bit ``j`` of byte ``k`` is value ``8k + j`` inside the interval."""
    n = x.size
    full = min(k1, n // 8)
    for k in range(k0, full):
        acc = 0
        for j in range(8):
            acc |= _inside(x[8 * k + j], lo, hi, lo_open, hi_open) << j
        out[k] = acc
    for k in range(max(k0, full), k1):  # the last, partial byte
        acc = 0
        for j in range(n - 8 * k):
            acc |= _inside(x[8 * k + j], lo, hi, lo_open, hi_open) << j
        out[k] = acc


@cached_jit(parallel=True, fastmath=False)
def interval_bits(x: Any, lo: Any, hi: Any, lo_open: Any, hi_open: Any, out: Any) -> None:
    nbytes = out.size
    nchunks = -(-nbytes // _BYTES)
    for c in prange(nchunks):
        _interval_bytes(x, lo, hi, lo_open, hi_open, out, c * _BYTES, min(nbytes, (c + 1) * _BYTES))


@cached_jit(fastmath=False)
def interval_bits_serial(x: Any, lo: Any, hi: Any, lo_open: Any, hi_open: Any, out: Any) -> None:
    _interval_bytes(x, lo, hi, lo_open, hi_open, out, 0, out.size)
