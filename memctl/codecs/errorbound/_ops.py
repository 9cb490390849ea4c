"""The per-group steps of the ``errorbound`` codec, written once for two targets.

The steps (plan, pack, unpack) and the CPU kernels that loop over groups are plain
module-level functions here. :func:`make_group_ops` compiles copies of them for one target
(NOTE [ One source, two targets ]): ``numba.cuda.jit(device=True)`` for the CUDA kernels in
:mod:`memctl.codecs.errorbound._cuda`, ``numba.njit`` (with the loops cached on disk) for the
CPU kernels in :mod:`memctl.codecs.errorbound._cpu`. Nothing here imports Numba at import
time; run as plain Python (on NumPy scalars, as the CUDA simulator does) the functions give
the same results.

NOTE [ One source, two targets ]
Numba resolves a function's globals when it compiles it. :func:`make_group_ops` makes a
copy of each function over one new globals dictionary (this module's names, the target's
scalar casts, and every step replaced by its compiled copy), so a step calls the other
steps compiled for the same target. The copies keep this file as their source: the CPU
loops' on-disk cache entries live next to it and are invalidated whenever it changes
(NOTE [ Kernel cache ] in :mod:`memctl.codecs._numba`), and they are not closures, so their
cache entries are valid in every process.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from memctl.codecs.errorbound._format import (
    EG_CLAMP,
    FLT_MAX,
    MAX_BITS,
    MODE_BITS,
    MODE_RAW,
    MODE_SPARSE,
    Q_LIMIT,
    STEP_FACTOR,
)

__all__ = ["STEPS", "GroupOps", "cuda_signatures", "make_group_ops"]

# Scalar casts: NumPy's here; each target gets Numba's (make_group_ops).
float32: Any = np.float32
float64: Any = np.float64
int32: Any = np.int32
int64: Any = np.int64
uint8: Any = np.uint8
prange: Any = range  # numba.prange in the CPU copies

STEPS = (
    "bit_width", "quantize", "plan", "or_byte", "pack", "read_bits", "raw_value",
    "unpack_group", "popcount8", "unpack_value",
)
"""The per-group steps, in the order :func:`make_group_ops` compiles them."""
LOOPS = ("plan_groups", "pack_groups", "unpack_groups", "plan_serial", "pack_serial", "unpack_serial")
"""The CPU loops over groups (parallel, then serial)."""


class GroupOps(NamedTuple):
    """The per-group steps compiled for one target, and the CPU loops when compiled for the CPU."""

    plan: Any
    pack: Any
    unpack_group: Any
    unpack_value: Any
    loops: dict[str, Any]


def make_group_ops(
    jit: Any, loop_jit: Callable[[bool], Any] | None = None
) -> GroupOps:
    """Compile the steps with ``jit`` (``numba.njit`` or ``cuda.jit(device=True)``).

    With ``loop_jit`` (a decorator factory taking ``parallel``), also the CPU loops over
    groups. Every integer is widened to int64 before it is shifted or combined, and every
    float to float64 before arithmetic, so that Numba, Numba-CUDA and the CUDA simulator
    (which runs this code as Python on NumPy scalars) type it identically.
    """
    import numba

    nb: Any = numba
    g: dict[str, Any] = dict(globals())
    g.update(float32=nb.float32, float64=nb.float64, int32=nb.int32, int64=nb.int64, uint8=nb.uint8,
             prange=nb.prange)
    for name in STEPS:
        g[name] = jit(_copy(globals()[name], g))
    loops: dict[str, Any] = {}
    if loop_jit is not None:
        for name in LOOPS:
            loops[name] = g[name] = loop_jit(not name.endswith("_serial"))(_copy(globals()[name], g))
    return GroupOps(g["plan"], g["pack"], g["unpack_group"], g["unpack_value"], loops)


def _copy(fn: Any, g: dict[str, Any]) -> Any:
    """``fn`` over the globals ``g`` (NOTE [ One source, two targets ])."""
    copy = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    return copy


def bit_width(r: Any) -> Any:
    """The smallest b with 2^b > r (r >= 0): bits for codes 0..r."""
    b = int64(0)
    while b < 31 and (int64(1) << b) <= r:
        b += 1
    return b


def quantize(xv: Any, s: Any) -> Any:
    """Grid index of ``xv`` (float64) for step ``s`` (float64), rounding half up."""
    return int64(math.floor(xv / s + 0.5))


def plan(
    x: Any, g: Any, n: Any, gs: Any, e: Any, cast_rel: Any, cast_min: Any, shrink: Any,
    vmax: Any, raw_width: Any, mode: Any, qmin: Any, step: Any, size: Any,
) -> None:
    """Pass 1 for group ``g``: its mode, qmin, step and payload size in bytes."""
    start = g * gs
    end = min(start + gs, n)
    length = end - start
    ok = True
    m = float64(0.0)
    for i in range(start, end):
        a = abs(float64(x[i]))
        if not (a <= FLT_MAX):  # NaN or +-Inf
            ok = False
            break
        if a > m:
            m = a
    eg = float64(e)
    if cast_rel > 0.0:
        h = (m + e) * cast_rel
        if h < cast_min:
            h = cast_min
        eg = (e - h) * shrink
    if eg > EG_CLAMP:
        eg = float64(EG_CLAMP)
    s32 = float32(0.0)
    if ok and eg > 0.0:
        s32 = float32(eg * STEP_FACTOR)
    s = float64(s32)
    ok = ok and s > 0.0
    lim = Q_LIMIT * s
    qlo = int64(1) << 40
    qhi = -(int64(1) << 40)
    nnz = int64(0)
    if ok:
        for i in range(start, end):
            xv = float64(x[i])
            if not (abs(xv) <= lim):
                ok = False
                break
            q = quantize(xv, s)
            prod = float64(q) * s
            if not (abs(prod) <= vmax):
                ok = False
                break
            v = float64(float32(prod))
            if not (abs(v - xv) <= eg):
                ok = False
                break
            if q < qlo:
                qlo = q
            if q > qhi:
                qhi = q
            nnz += int64(q != 0)
    b = int64(0)
    if ok:
        b = bit_width(qhi - qlo)
        ok = b <= MAX_BITS
    if not ok:
        mode[g] = uint8(MODE_RAW)
        qmin[g] = int32(0)
        step[g] = float32(0.0)
        size[g] = (length * raw_width) // 8
        return
    dense = (length * b + 7) // 8
    sparse = (length + nnz * b + 7) // 8
    if b > 0 and sparse < dense:
        mode[g] = uint8(b | MODE_SPARSE)
        size[g] = sparse
    else:
        mode[g] = uint8(b)
        size[g] = dense
    qmin[g] = int32(qlo)
    step[g] = s32


def or_byte(payload: Any, p: Any, bits: Any) -> None:
    """OR the low 8 bits of ``bits`` into ``payload[p]`` (the payload starts zeroed)."""
    payload[p] = uint8(int64(payload[p]) | (bits & 255))


def pack(
    x: Any, xraw: Any, g: Any, n: Any, gs: Any, raw_width: Any,
    mode: Any, qmin: Any, step: Any, offset: Any, payload: Any,
) -> None:
    """Pass 2 for group ``g``: OR its bits, LSB first, into the zeroed payload at ``offset[g]``.

    One pass over the values and no data-dependent branch per value (ReLU data makes
    ``q != 0`` a coin flip): a sparse group's bitmap bits and codes go to their two
    regions as they come, and a skipped code is a zero-width one.
    """
    start = g * gs
    length = min(start + gs, n) - start
    md = int64(mode[g])
    raw = (md & MODE_RAW) != 0
    sparse = (md & MODE_SPARSE) != 0
    width = raw_width if raw else md & MODE_BITS
    if width == 0:
        return
    first = int64(offset[g])
    s = float64(step[g])
    lo = int64(qmin[g])
    mask = (int64(1) << raw_width) - 1
    p = first  # next byte of the code stream
    acc = int64(0)  # pending code bits: fewer than 32 between codes, so at most 63
    nacc = int64(0)
    if sparse:  # the codes follow the length-bit bitmap
        p = first + (length >> 3)
        nacc = length & 7
    bitmap = int64(0)
    for k in range(length):
        keep = int64(1)
        if raw:
            code = int64(xraw[start + k]) & mask
        else:
            q = quantize(float64(x[start + k]), s)
            if sparse:
                keep = int64(q != 0)
            code = (q - lo) * keep
        if sparse:
            bitmap |= keep << (k & 7)
            if (k & 7) == 7:
                or_byte(payload, first + (k >> 3), bitmap)
                bitmap = int64(0)
        acc |= code << nacc
        nacc += width * keep
        if nacc >= 32:
            for j in range(4):
                or_byte(payload, p + j, acc >> (8 * j))
            p += 4
            acc >>= 32
            nacc -= 32
    if sparse and (length & 7) != 0:
        or_byte(payload, first + (length >> 3), bitmap)
    while nacc > 0:
        or_byte(payload, p, acc)
        p += 1
        acc >>= 8
        nacc -= 8


def read_bits(payload: Any, pos: Any, w: Any) -> Any:
    """The ``w``-bit code at bit ``pos`` of ``payload`` (0 when w == 0).

    Reads only the bytes holding bits pos .. pos + w - 1: none when w == 0 and pos is
    byte-aligned, else bytes that the group owns (the one holding bit pos - 1).
    """
    first = pos >> 3
    sh = pos & 7
    acc = int64(0)
    for j in range((sh + w + 7) >> 3):
        acc |= int64(payload[first + j]) << (8 * j)
    return (acc >> sh) & ((int64(1) << w) - 1)


def raw_value(code: Any, exp_bits: Any, man_bits: Any) -> Any:
    """The float64 value of a float16/bfloat16/float32 bit pattern (NaN made canonical)."""
    man = code & ((int64(1) << man_bits) - 1)
    ex = (code >> man_bits) & ((int64(1) << exp_bits) - 1)
    neg = ((code >> (man_bits + exp_bits)) & 1) != 0
    bias = (int64(1) << (exp_bits - 1)) - 1
    if ex == (int64(1) << exp_bits) - 1:
        val = math.inf if man == 0 else math.nan
    elif ex == 0:
        val = math.ldexp(float64(man), int(1 - bias - man_bits))
    else:
        val = math.ldexp(float64(man + (int64(1) << man_bits)), int(ex - bias - man_bits))
    return -val if neg else val


def unpack_group(
    payload: Any, g: Any, n: Any, gs: Any, exp_bits: Any, man_bits: Any,
    mode: Any, qmin: Any, step: Any, offset: Any, out: Any,
) -> None:
    """Decode group ``g`` sequentially into ``out`` (float32)."""
    start = g * gs
    end = min(start + gs, n)
    md = int64(mode[g])
    base = int64(offset[g]) * 8
    if (md & MODE_RAW) != 0:
        w = 1 + exp_bits + man_bits
        for i in range(start, end):
            code = read_bits(payload, base + (i - start) * w, w)
            out[i] = float32(raw_value(code, exp_bits, man_bits))
        return
    b = md & MODE_BITS
    s = float64(step[g])
    lo = int64(qmin[g])
    if (md & MODE_SPARSE) != 0:
        pos = base + (end - start)
        for i in range(start, end):  # branch-free: a zero is a zero-width code and q = 0
            nz = read_bits(payload, base + (i - start), 1)
            q = (read_bits(payload, pos, b * nz) + lo) * nz
            pos += b * nz
            out[i] = float32(float64(q) * s)
    else:
        for i in range(start, end):
            q = read_bits(payload, base + (i - start) * b, b) + lo
            out[i] = float32(float64(q) * s)


def popcount8(v: Any) -> Any:
    """Number of set bits of a byte."""
    c = int64(v)
    c = c - ((c >> 1) & 0x55)
    c = (c & 0x33) + ((c >> 2) & 0x33)
    return (c + (c >> 4)) & 0x0F


def unpack_value(
    payload: Any, i: Any, n: Any, gs: Any, exp_bits: Any, man_bits: Any,
    mode: Any, qmin: Any, step: Any, offset: Any, out: Any,
) -> None:
    """Decode value ``i`` alone into ``out[i]`` (the same result as :func:`unpack_group`)."""
    g = i // gs
    j = i - g * gs
    length = min(gs, n - g * gs)
    md = int64(mode[g])
    base = int64(offset[g]) * 8
    if (md & MODE_RAW) != 0:
        w = 1 + exp_bits + man_bits
        out[i] = float32(raw_value(read_bits(payload, base + j * w, w), exp_bits, man_bits))
        return
    b = md & MODE_BITS
    lo = int64(qmin[g])
    if (md & MODE_SPARSE) != 0:
        if read_bits(payload, base + j, 1) == 0:
            out[i] = float32(0.0)
            return
        first = int64(offset[g])
        rank = int64(0)
        for k in range(j >> 3):
            rank += popcount8(payload[first + k])
        rest = j & 7
        if rest != 0:
            rank += popcount8(int64(payload[first + (j >> 3)]) & ((int64(1) << rest) - 1))
        q = read_bits(payload, base + length + rank * b, b) + lo
    else:
        q = read_bits(payload, base + j * b, b) + lo
    out[i] = float32(float64(q) * float64(step[g]))


def plan_groups(
    x: Any, n: Any, gs: Any, e: Any, cast_rel: Any, cast_min: Any, shrink: Any, vmax: Any,
    raw_width: Any, mode: Any, qmin: Any, step: Any, size: Any,
) -> None:
    """CPU pass 1 over all groups, one ``prange`` iteration per group."""
    for g in prange(mode.shape[0]):
        plan(x, g, n, gs, e, cast_rel, cast_min, shrink, vmax, raw_width, mode, qmin, step, size)


def pack_groups(
    x: Any, xraw: Any, n: Any, gs: Any, raw_width: Any,
    mode: Any, qmin: Any, step: Any, offset: Any, payload: Any,
) -> None:
    """CPU pass 2 over all groups, one ``prange`` iteration per group."""
    for g in prange(mode.shape[0]):
        pack(x, xraw, g, n, gs, raw_width, mode, qmin, step, offset, payload)


def unpack_groups(
    payload: Any, n: Any, gs: Any, exp_bits: Any, man_bits: Any,
    mode: Any, qmin: Any, step: Any, offset: Any, out: Any,
) -> None:
    """CPU decoding, one ``prange`` iteration per group."""
    for g in prange(mode.shape[0]):
        unpack_group(payload, g, n, gs, exp_bits, man_bits, mode, qmin, step, offset, out)


def plan_serial(
    x: Any, n: Any, gs: Any, e: Any, cast_rel: Any, cast_min: Any, shrink: Any, vmax: Any,
    raw_width: Any, mode: Any, qmin: Any, step: Any, size: Any,
) -> None:
    """:func:`plan_groups` in one thread."""
    for g in range(mode.shape[0]):
        plan(x, g, n, gs, e, cast_rel, cast_min, shrink, vmax, raw_width, mode, qmin, step, size)


def pack_serial(
    x: Any, xraw: Any, n: Any, gs: Any, raw_width: Any,
    mode: Any, qmin: Any, step: Any, offset: Any, payload: Any,
) -> None:
    """:func:`pack_groups` in one thread."""
    for g in range(mode.shape[0]):
        pack(x, xraw, g, n, gs, raw_width, mode, qmin, step, offset, payload)


def unpack_serial(
    payload: Any, n: Any, gs: Any, exp_bits: Any, man_bits: Any,
    mode: Any, qmin: Any, step: Any, offset: Any, out: Any,
) -> None:
    """:func:`unpack_groups` in one thread."""
    for g in range(mode.shape[0]):
        unpack_group(payload, g, n, gs, exp_bits, man_bits, mode, qmin, step, offset, out)


def cuda_signatures() -> dict[str, list[Any]]:
    """Argument types of the CUDA kernels, compiled eagerly so a missing toolchain shows at once."""
    from numba import types as nt

    f32, i16, i32, i64, u8 = (nt.float32[::1], nt.int16[::1], nt.int32[::1], nt.int64[::1], nt.uint8[::1])
    f64 = nt.float64
    meta = (u8, i32, f32)
    return {
        "plan": [nt.void(f32, nt.int64, nt.int64, f64, f64, f64, f64, f64, nt.int64, *meta, i64)],
        "pack": [nt.void(f32, raw, nt.int64, nt.int64, nt.int64, *meta, i64, u8) for raw in (i16, i32)],
        "unpack": [nt.void(u8, nt.int64, nt.int64, nt.int64, nt.int64, *meta, i64, f32)],
    }
