"""Numba CPU kernels of the ``quantize`` codec (NOTE [ Quantize CPU kernel ] in ``_kernels``).

Module-level functions compiled with ``cache=True`` (NOTE [ Kernel cache ] in
:mod:`memctl.codecs._numba`). This module imports Numba at its top, so it is imported only on
a codec's first CPU use (:func:`memctl.codecs.quantize._kernels.cpu_kernels`).

The work of a range of groups is one function (``_encode_groups``, ``_decode_groups``); the
parallel entry points run chunks of groups in a ``prange``, the serial ones run all groups
in one call, so both compile the same per-group code and write the same bytes.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import prange

from memctl.codecs import _rng
from memctl.codecs._numba import cached_jit

__all__ = ["decode", "decode_affine", "decode_affine_serial", "decode_serial", "encode", "encode_serial",
           "square_read_segments", "square_read_serial"]

_lowbias32 = numba.njit(inline="always")(_rng.lowbias32_numba)


@numba.njit(inline="always")
def _key(seed: Any, hi: Any) -> Any:
    m = np.uint64(0xFFFFFFFF)
    return _lowbias32(np.uint64(seed) ^ ((np.uint64(hi) * np.uint64(0x9E3779B9)) & m))


@cached_jit(fastmath=False)
def _encode_groups(
    x: Any, g0: Any, g1: Any, group: Any, bits: Any, seed: Any, meta: Any, payload: Any,
    positive: Any, want_positive: Any,
) -> Any:
    """Encode groups ``g0 .. g1 - 1``; the number of them holding a non-finite value.

    With ``want_positive``, also write the bit mask of ``x > 0`` into ``positive`` (bit
    ``i % 8`` of byte ``i // 8``, the bits past the end 0; NOTE [ Positive mask in encode ]).
    """
    n = x.size
    big = (1 << bits) - 1
    scale = np.float64(big) * 16777216.0
    gbytes = group * bits // 8
    xi = x.view(np.int32)
    m32 = np.uint64(0xFFFFFFFF)
    codes = np.zeros(group, np.uint8)
    scratch = np.empty(2, np.int32)
    scratch_f = scratch.view(np.float32)
    nbad = 0
    for g in range(g0, g1):
        s = g * group
        e = min(s + group, n)
        m = e - s
        # Zero-based loops over slices: no negative-index wrap-around, so LLVM vectorises.
        xs = x[s:e]
        bs = xi[s:e]
        # (1) min/max over finite values as integer keys ordered like the floats.
        lo = np.int32(0x7FFFFFFF)
        hi = np.int32(-0x7FFFFFFF - 1)
        amax = np.int32(0)
        for j in range(m):
            b = bs[j]
            a = b & np.int32(0x7FFFFFFF)
            k = b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF))
            fin = a < np.int32(0x7F800000)
            klo = k if fin else np.int32(0x7FFFFFFF)
            khi = k if fin else np.int32(-0x7FFFFFFF - 1)
            lo = klo if klo < lo else lo
            hi = khi if khi > hi else hi
            amax = a if a > amax else amax
        special = amax >= np.int32(0x7F800000)
        nbad += 1 if special else 0
        scratch[0] = lo ^ ((lo >> np.int32(31)) & np.int32(0x7FFFFFFF))
        scratch[1] = hi ^ ((hi >> np.int32(31)) & np.int32(0x7FFFFFFF))
        mn = scratch_f[0]
        mx = scratch_f[1]
        if lo > hi:  # no finite value
            mn = np.float32(0.0)
            mx = np.float32(0.0)
        mn = mn + np.float32(0.0)  # -0.0 -> +0.0: one canonical zero
        mx = mx + np.float32(0.0)
        meta[g, 0] = mn
        meta[g, 1] = mx
        if want_positive:  # groups start on a multiple of 8 values, so on a mask byte
            po = positive[s >> 3 : (e + 7) >> 3]
            for k in range(m >> 3):
                acc = 0
                for j in range(8):
                    acc |= (1 if xs[8 * k + j] > np.float32(0.0) else 0) << j
                po[k] = acc
            if m & 7:
                acc = 0
                for j in range(m & 7):
                    acc |= (1 if xs[(m & ~7) + j] > np.float32(0.0) else 0) << j
                po[m >> 3] = acc
        # (2) codes
        mn64 = np.float64(mn)
        rng = np.float64(mx) - mn64
        sc = scale / rng if rng > 0.0 else 0.0
        hi32 = s >> 32
        key = _key(seed, hi32)
        if not special and ((e - 1) >> 32) == hi32:
            for j in range(m):
                t = np.int64((np.float64(xs[j]) - mn64) * sc)
                r = np.int64(_lowbias32((np.uint64(s + j) & m32) ^ key) >> np.uint64(8))
                codes[j] = min((t + r) >> 24, big)
        else:
            for j in range(m):
                v = xs[j]
                q = 0
                if abs(v) <= np.float32(3.4028234663852886e38):
                    i = s + j
                    kk = key if (i >> 32) == hi32 else _key(seed, i >> 32)
                    t = np.int64((np.float64(v) - mn64) * sc)
                    r = np.int64(_lowbias32((np.uint64(i) & m32) ^ kk) >> np.uint64(8))
                    q = min((t + r) >> 24, big)
                codes[j] = q
        for j in range(m, group):
            codes[j] = 0
        # (3) packing, little-endian within a byte
        out = payload[g * gbytes : (g + 1) * gbytes]
        if bits == 2:
            for k in range(gbytes):
                out[k] = (
                    codes[4 * k] | (codes[4 * k + 1] << 2) | (codes[4 * k + 2] << 4) | (codes[4 * k + 3] << 6)
                )
        elif bits == 1:
            for k in range(gbytes):
                out[k] = (
                    codes[8 * k]
                    | (codes[8 * k + 1] << 1)
                    | (codes[8 * k + 2] << 2)
                    | (codes[8 * k + 3] << 3)
                    | (codes[8 * k + 4] << 4)
                    | (codes[8 * k + 5] << 5)
                    | (codes[8 * k + 6] << 6)
                    | (codes[8 * k + 7] << 7)
                )
        elif bits == 4:
            for k in range(gbytes):
                out[k] = codes[2 * k] | (codes[2 * k + 1] << 4)
        else:
            for k in range(gbytes):
                out[k] = codes[k]
    return nbad


@numba.njit(inline="always")
def _levels(meta: Any, g: Any, big: Any, lv: Any) -> None:
    """The ``big + 1`` float32 values group ``g``'s codes stand for, each within its range."""
    mn = meta[g, 0]
    mx = meta[g, 1]
    mn64 = np.float64(mn)
    rng = np.float64(mx) - mn64
    for q in range(big + 1):
        y = np.float32(mn64 + (np.float64(q) * rng) / np.float64(big))
        y = mn if y < mn else y
        lv[q] = mx if y > mx else y


@numba.njit(inline="always")
def _code(ps: Any, j: Any, bits: Any, big: Any) -> Any:
    """Code ``j`` of a group's packed bytes ``ps`` (little-endian within a byte)."""
    return (ps[(j * bits) >> 3] >> ((j * bits) & 7)) & big


@cached_jit(fastmath=False)
def _decode_affine_groups(
    payload: Any, meta: Any, g0: Any, g1: Any, group: Any, bits: Any, out: Any, sub: Any, scale: Any,
    shift: Any, inner: Any, mask: Any, masked: Any, floor: Any,
) -> None:
    """Decode groups ``g0 .. g1 - 1`` into ``out`` through the channel map of NOTE [ Fused
    channel passes ] (``memctl.codecs.channels``): each value ``(v - sub[c])·scale[c] +
    shift[c]`` for its channel ``c`` (blocks of ``inner`` values, block ``k`` is channel
    ``k % C``), then with ``masked`` ``max(·, floor)`` times its mask bit, the same float32
    operations in the same order as ``channels.affine`` applied to the decoded tensor. A
    group inside one block maps its levels instead of its values."""
    n = out.size
    channels = sub.size
    big = (1 << bits) - 1
    gbytes = group * bits // 8
    lv = np.empty(big + 1, np.float32)
    outi = out.view(np.int32)
    block = g0 * group // inner  # the block (and channel) of the group's first value, kept up to date
    c = block % channels
    block_end = (block + 1) * inner
    for g in range(g0, g1):
        _levels(meta, g, big, lv)
        s = g * group
        e = min(s + group, n)
        ps = payload[g * gbytes : (g + 1) * gbytes]
        while s >= block_end:
            block_end += inner
            c = c + 1 if c + 1 < channels else 0
        finite = True
        if e <= block_end:
            for q in range(big + 1):
                y = (lv[q] - sub[c]) * scale[c] + shift[c]
                if masked:
                    y = floor if y < floor else y
                finite = finite and abs(y) <= np.float32(3.4028234663852886e38)
                lv[q] = y
            # off the mask: y·0, which is +0.0 (what the bits AND 0 give) when y >= floor is finite
            if finite:
                _write_group(ps, lv, out, outi, s, e, group, bits, big, mask, masked)
            else:
                for j in range(e - s):
                    y = lv[_code(ps, j, bits, big)]
                    if masked:
                        y = y * np.float32((mask[(s + j) >> 3] >> ((s + j) & 7)) & 1)
                    out[s + j] = y
        else:
            for j in range(e - s):
                cj = ((s + j) // inner) % channels
                y = (lv[_code(ps, j, bits, big)] - sub[cj]) * scale[cj] + shift[cj]
                if masked:
                    y = floor if y < floor else y
                    y = y * np.float32((mask[(s + j) >> 3] >> ((s + j) & 7)) & 1)
                out[s + j] = y


@cached_jit(fastmath=False)
def _decode_groups(
    payload: Any, meta: Any, g0: Any, g1: Any, group: Any, bits: Any, out: Any,
    mask: Any, masked: Any, floor: Any,
) -> None:
    """Decode groups ``g0 .. g1 - 1`` into ``out``; with ``masked``, apply the mask bits too.

    A value whose bit in ``mask`` (bit ``i % 8`` of byte ``i // 8``) is 0 becomes +0.0, one
    whose bit is 1 becomes ``max(value, floor)`` (NOTE [ Masked decode ] in the codec module).
    """
    n = out.size
    big = (1 << bits) - 1
    gbytes = group * bits // 8
    lv = np.empty(big + 1, np.float32)
    outi = out.view(np.int32)
    for g in range(g0, g1):
        _levels(meta, g, big, lv)
        if masked:  # the floor applied to the levels is the floor applied to the values
            for q in range(big + 1):
                lv[q] = floor if lv[q] < floor else lv[q]
        s = g * group
        _write_group(payload[g * gbytes : (g + 1) * gbytes], lv, out, outi, s, min(s + group, n), group, bits,
                     big, mask, masked)


@numba.njit(inline="always")
def _write_group(ps: Any, lv: Any, out: Any, outi: Any, s: Any, e: Any, group: Any, bits: Any, big: Any,
                 mask: Any, masked: Any) -> None:
    """Values ``s .. e - 1`` of ``out``: level ``lv[code]`` of each code in the group's packed bytes
    ``ps``; with ``masked``, a value whose mask bit is 0 becomes +0.0 (its bits AND 0)."""
    m = e - s
    os = out[s:e]
    if m == group and bits == 2:
        for k in range(ps.size):
            b = ps[k]
            os[4 * k] = lv[b & 3]
            os[4 * k + 1] = lv[(b >> 2) & 3]
            os[4 * k + 2] = lv[(b >> 4) & 3]
            os[4 * k + 3] = lv[b >> 6]
    elif m == group and bits == 1:
        for k in range(ps.size):
            b = ps[k]
            for j in range(8):
                os[8 * k + j] = lv[(b >> j) & 1]
    elif m == group and bits == 4:
        for k in range(ps.size):
            b = ps[k]
            os[2 * k] = lv[b & 15]
            os[2 * k + 1] = lv[b >> 4]
    elif bits == 8:
        for j in range(m):
            os[j] = lv[ps[j]]
    else:
        for j in range(m):
            os[j] = lv[_code(ps, j, bits, big)]
    if masked:  # groups start on a multiple of 8 values, so on a mask byte
        # The levels are raised to the floor above; a value off the mask becomes its bits
        # AND 0 (+0.0): integer operations and no branch on the mask bits (a ReLU mask is
        # as unpredictable as a coin), so the loop vectorises. A branch here cost 8 ns a value.
        ms = mask[s >> 3 : (e + 7) >> 3]
        oi = outi[s:e]
        for k in range(m >> 3):
            mb = np.int32(ms[k])
            for j in range(8):
                oi[8 * k + j] &= -((mb >> j) & 1)
        for j in range(m & ~7, m):
            oi[j] &= -((np.int32(ms[j >> 3]) >> (j & 7)) & 1)


@cached_jit(parallel=True, fastmath=False)
def encode(
    x: Any, group: Any, bits: Any, seed: Any, meta: Any, payload: Any, bad: Any,
    positive: Any, want_positive: Any,
) -> None:
    """Parallel encode: ``bad.size`` chunks of whole groups, one ``prange`` iteration each."""
    ngroups = meta.shape[0]
    nchunks = bad.size
    for c in prange(nchunks):
        bad[c] = _encode_groups(
            x, c * ngroups // nchunks, (c + 1) * ngroups // nchunks, group, bits, seed, meta, payload,
            positive, want_positive,
        )


@cached_jit(fastmath=False)
def encode_serial(
    x: Any, group: Any, bits: Any, seed: Any, meta: Any, payload: Any, bad: Any,
    positive: Any, want_positive: Any,
) -> None:
    """Serial encode: every group in one call (``bad`` has one entry)."""
    bad[0] = _encode_groups(x, 0, meta.shape[0], group, bits, seed, meta, payload, positive, want_positive)


@cached_jit(parallel=True, fastmath=False)
def decode(
    payload: Any, meta: Any, group: Any, bits: Any, out: Any, mask: Any, masked: Any, floor: Any
) -> None:
    """Parallel decode: up to 256 chunks of whole groups."""
    ngroups = meta.shape[0]
    nchunks = min(ngroups, 256)
    for c in prange(nchunks):
        _decode_groups(
            payload, meta, c * ngroups // nchunks, (c + 1) * ngroups // nchunks, group, bits, out,
            mask, masked, floor,
        )


@cached_jit(fastmath=False)
def decode_serial(
    payload: Any, meta: Any, group: Any, bits: Any, out: Any, mask: Any, masked: Any, floor: Any
) -> None:
    """Serial decode: every group in one call."""
    _decode_groups(payload, meta, 0, meta.shape[0], group, bits, out, mask, masked, floor)


@cached_jit(parallel=True, fastmath=False)
def decode_affine(
    payload: Any, meta: Any, group: Any, bits: Any, out: Any, sub: Any, scale: Any, shift: Any, inner: Any,
    mask: Any, masked: Any, floor: Any,
) -> None:
    """Parallel decode through a channel map: up to 256 chunks of whole groups."""
    ngroups = meta.shape[0]
    nchunks = min(ngroups, 256)
    for c in prange(nchunks):
        _decode_affine_groups(
            payload, meta, c * ngroups // nchunks, (c + 1) * ngroups // nchunks, group, bits, out,
            sub, scale, shift, inner, mask, masked, floor,
        )


@cached_jit(fastmath=False)
def decode_affine_serial(
    payload: Any, meta: Any, group: Any, bits: Any, out: Any, sub: Any, scale: Any, shift: Any, inner: Any,
    mask: Any, masked: Any, floor: Any,
) -> None:
    """Serial decode through a channel map: every group in one call."""
    _decode_affine_groups(
        payload, meta, 0, meta.shape[0], group, bits, out, sub, scale, shift, inner, mask, masked, floor,
    )


@numba.njit(inline="always")
def _step_variance(meta: Any, g: Any, big: Any) -> Any:
    """``Δ²/6`` of group ``g`` (its step ``Δ`` the range over ``big``), float32."""
    step = (meta[g, 1] - meta[g, 0]) / big
    return step * step * np.float32(1.0 / 6.0)


@numba.njit(inline="always")
def _toward(v: Any, center: Any, var: Any) -> Any:
    """``v`` moved towards ``center`` so its squared distance from it falls by ``var`` (clamped
    at 0), on its side of it (NOTE [ Squares of a rounded result ])."""
    d = v - center
    r2 = d * d - var
    r = np.float32(np.sqrt(r2)) if r2 > 0 else np.float32(0.0)
    return center + (r if d >= 0 else -r)


@cached_jit(fastmath=False)
def square_read_serial(values: Any, meta: Any, group: Any, bits: Any, center: Any, offset: Any,
                       out: Any) -> None:
    """``out``: ``values`` (a record's decode, value ``i`` in group ``(offset + i) // group`` with
    that group's row of ``meta``; ``offset`` is where the record starts in its first group, 0
    but for a batch's record) moved towards ``center`` so their squared distance from it falls
    by ``step**2 / 6`` (clamped at 0), on their side of it (NOTE [ Squares of a rounded result ]
    in memctl/controller/squares.py)."""
    big = np.float32((1 << bits) - 1)
    n = values.size
    for g in range(meta.shape[0]):
        var = _step_variance(meta, g, big)
        for i in range(max(0, g * group - offset), min(n, (g + 1) * group - offset)):
            out[i] = _toward(values[i], center, var)


@cached_jit(fastmath=False)
def square_read_segments(values: Any, meta: Any, group: Any, bits: Any, starts: Any, ends: Any,
                         centers: Any, out: Any) -> None:
    """:func:`square_read_serial` over the segments ``[starts[k], ends[k])`` of a batch's values
    (value ``i`` in group ``i // group``), each towards its ``centers[k]``: the batch's records
    read squared, corrected in one call (NOTE [ Squares of a rounded result ]); the values
    outside every segment are left unwritten."""
    big = np.float32((1 << bits) - 1)
    for k in range(starts.size):
        center = centers[k]
        end = ends[k]
        i = starts[k]
        while i < end:
            g = i // group
            var = _step_variance(meta, g, big)
            stop = min(end, (g + 1) * group)
            while i < stop:
                out[i] = _toward(values[i], center, var)
                i += 1
