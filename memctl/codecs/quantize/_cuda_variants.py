"""Other builds of the warp-team encode of ``quantize``, to be timed against today's (``_cuda_teams``).

NOTE [ Team kernel variants ]
Nsight Compute found the team encode bound by instruction issue and latency, not memory
(benchmarks/README.md, "Codec throughput"): 128 registers at the launch bound, spills, and
~45% of stalls on fixed-latency dependencies. In today's code loop each value sits behind its
own branch (``k < cnt and abs(val) <= _FMAX``), so the compiler cannot interleave the float64
chain and hash of one value with those of the next. Each variant here changes one thing, and
``LEAN`` combines those that help; :func:`team_kernels` (``_cuda_teams``) builds them by name:

- ``SELECT``: no branch per value. A value that is missing or not finite is replaced by the
  group's ``mn`` before the arithmetic: then ``T = trunc((mn - mn) * s) = 0`` (``s`` is finite:
  ``R >= 2**-149``), and ``(0 + r) >> 24 = 0`` since ``r < 2**24``, so its code is 0, as today.
  The min/max loop selects too. Every variant below starts from this one.
- ``FASTPATH``: a lane whose ``C`` values are all present and finite (nearly every lane) codes
  them without the test at all; others take ``SELECT``'s loop.
- ``SUM32``: ``q = (T + r) >> 24`` in 32 bits, with no carry split and no clamp. Both are no-ops:
  ``d = fl(x - mn) <= fl(mx - mn) = R`` (rounding is monotonic), ``s <= (K / R)(1 + 2**-53)``
  with ``K = B * 2**24``, so ``fl(d * s) < K + 1`` and ``T <= K``; then ``T + r <= K + 2**24 - 1
  <= 2**32 - 1`` (no wrap, ``B <= 255``) and ``(T + r) >> 24 <= B`` (the clamp never acts).
- ``NOPREFETCH``: no one-tile-ahead loads (``nxt``): each tile's values go straight from global
  to shared memory. 16 fewer live registers at 16 values a lane, against less latency hiding.
- ``WORDSTORE``: a lane's ``C * bits / 8`` payload bytes are consecutive and start at a multiple
  of their size, so each lane stores them as one 1-, 2-, 4- or 8-byte word (a warp's store is
  contiguous) instead of through shared memory and a second pass of byte stores. The payload is
  ``ngroups * G * bits / 8`` bytes, a multiple of the word, of a fresh allocation (aligned).
- ``ADDR``: cheaper addresses. Today each of a lane's 16 loads costs ~25 instructions (its own
  bounds tests, 64-bit index arithmetic, and Numba's wrap-around code for a signed index), and
  ptxas keeps one register per shared-memory address (~30 live registers: the spills). Here a
  tile wholly in range loads unguarded at unsigned indices that differ by constants (one
  instruction a load, immediate offsets), and shared memory is indexed by unsigned base plus
  constant; partial tiles take today's guarded loads.
- ``LEAN``: ``ADDR``, ``FASTPATH``, ``SUM32`` and ``WORDSTORE``.

Static counts (ptxas for sm_90 at the launch bound, 2 bits, 16 values a lane): ``BASE`` 128
registers and 32 bytes of spills; ``SELECT`` 40, ``SUM32`` 20; ``NOPREFETCH``, ``WORDSTORE``,
``ADDR`` and ``LEAN`` none. Timed on an H200 (benchmarks/README.md, 2026-11-28, second
session), none is faster than ``BASE`` beyond the spread between processes (2 bits: ``BASE``
0.30 of the copy's bandwidth, ``WORDSTORE`` 0.29 in the same call): fewer registers and no
spills did not buy speed, so the codec runs ``BASE``.

All write the payload, metadata and non-finite flag of today's encode, byte for byte
(``tests/codecs/test_quantize_cuda_variants.py`` in the simulator; ``kernel_variants.py`` on a GPU).
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import Any

import numpy as np

from memctl.codecs.quantize import _cuda_teams
from memctl.codecs.quantize._cuda_teams import _FMAX, WARP, WARPS_PER_BLOCK, _key32, cuda

__all__ = ["FEATURES", "Variant", "build_encode", "team_kernels"]


class Variant(str, Enum):
    """Builds of the team kernels (NOTE [ Team kernel variants ]). ``BASE`` is the one memctl runs;
    the others exist to be timed against it (``benchmarks/kernel_variants.py``) and write the same
    bytes."""

    BASE = "base"
    SELECT = "select"
    FASTPATH = "fastpath"
    SUM32 = "sum32"
    NOPREFETCH = "noprefetch"
    WORDSTORE = "wordstore"
    ADDR = "addr"
    LEAN = "lean"


@functools.cache
def team_kernels(bits: int, chunk: int, simulated: bool, variant: Variant) -> tuple[Any, Any]:
    """``_cuda_teams.team_kernels`` with the encode of ``variant`` (today's decode): built here, so
    that a benchmark may put this function in that one's place."""
    encode = (_cuda_teams._build_encode(bits, chunk, simulated) if variant is Variant.BASE
              else build_encode(bits, chunk, simulated, variant))
    return encode, _cuda_teams._build_decode(bits, chunk, simulated)


#: What each variant changes against ``BASE`` (NOTE [ Team kernel variants ]).
FEATURES: dict[Variant, frozenset[str]] = {
    Variant.SELECT: frozenset({"select"}),
    Variant.FASTPATH: frozenset({"select", "fastpath"}),
    Variant.SUM32: frozenset({"select", "sum32"}),
    Variant.NOPREFETCH: frozenset({"select", "noprefetch"}),
    Variant.WORDSTORE: frozenset({"select", "wordstore"}),
    Variant.ADDR: frozenset({"select", "addr"}),
    Variant.LEAN: frozenset({"select", "addr", "fastpath", "sum32", "wordstore"}),
}

_WORDS: dict[int, Any] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def build_encode(bits: int, chunk: int, simulated: bool, variant: Variant) -> Any:
    """The encode of ``variant`` (not ``BASE``), with today's arguments and results."""
    features = FEATURES[variant]
    fastpath = "fastpath" in features
    sum32 = "sum32" in features
    prefetch = "noprefetch" not in features
    wordstore = "wordstore" in features
    addr = "addr" in features
    C = chunk
    CB = C * bits // 8  # payload bytes per lane
    BIG = (1 << bits) - 1
    WPB = WARPS_PER_BLOCK
    XS = C * (WARP + 1)
    SB = WARP * CB if not wordstore else 1
    SCALE = np.float64(BIG) * 16777216.0
    WT = _WORDS[CB]
    sync = _cuda_teams._warp_sync(simulated)
    mix = _cuda_teams._mix32 if simulated else _cuda_teams._mix32_gpu

    _load_tile = _cuda_teams.tile_loader(C, simulated)
    _team_range = _cuda_teams.team_range(simulated)
    _positive_bits = _cuda_teams.positive_writer(C, simulated)

    @cuda.jit(device=True)
    def _load_full(x: Any, n: Any, tile: Any, ntiles: Any, tile_vals: Any, lane: Any, dest: Any) -> None:
        """:func:`_load_tile` with one test per tile: a whole tile in range loads unguarded, at
        unsigned indices (no wrap-around code) that differ by constants."""
        s0 = np.int64(tile) * tile_vals
        if tile < ntiles and tile_vals == WARP * C and s0 + WARP * C <= n:
            base = np.uint64(s0 + lane)
            for j in range(C):
                dest[j] = x[base + np.uint64(j * WARP)]
        else:
            _load_tile(x, n, tile, ntiles, tile_vals, lane, dest)

    @cuda.jit(device=True)
    def _code(val: Any, k: Any, mn64: Any, sc: Any, lo: Any, key: Any) -> Any:
        """The code of a finite value ``val`` at position ``k`` of the lane (or of ``mn``: 0)."""
        t = np.uint32((np.float64(val) - mn64) * sc)
        r = np.uint32(mix(np.uint32(lo + np.uint32(k)) ^ key) >> np.uint32(8))
        if sum32:  # T + r < 2**32 and (T + r) >> 24 <= B (NOTE [ Team kernel variants ])
            return np.uint32(np.uint32(t + r) >> np.uint32(24))
        carry = np.uint32((np.uint32(t & np.uint32(0xFFFFFF)) + r) >> np.uint32(24))
        q = np.uint32(np.uint32(t >> np.uint32(24)) + carry)
        return q if q < BIG else np.uint32(BIG)

    @cuda.jit(**_cuda_teams._kernel_options(simulated))
    def encode(
        x: Any, n: Any, group: Any, seed: Any, meta: Any, payload: Any, bad: Any, positive: Any,
        want_positive: Any,
    ) -> None:
        sx = cuda.shared.array((WPB, XS), np.float32)
        smn = cuda.shared.array((WPB, WARP), np.float32)
        smx = cuda.shared.array((WPB, WARP), np.float32)
        sb = cuda.shared.array((WPB, SB), np.uint8)
        v = cuda.local.array(C, np.float32)
        nxt = cuda.local.array(C, np.float32)
        tid = cuda.threadIdx.x
        w = tid // WARP
        lane = tid % WARP
        team_size = group // C
        per_tile = WARP // team_size
        team = lane // team_size
        tl = lane - team * team_size
        tile_vals = per_tile * group
        ngroups = meta.shape[0]
        ntiles = (ngroups + per_tile - 1) // per_tile
        nbytes = payload.shape[0]
        c0 = lane * C
        nonfinite = 0
        stride = cuda.gridDim.x * WPB
        wu = np.uint32(tid) >> np.uint32(5)  # unsigned shared-memory indices (NOTE [ Team kernel variants ])
        lu = np.uint32(tid) & np.uint32(WARP - 1)
        ru = np.uint32(lu * C + ((lu * C) >> 5))  # the lane's first value in the padded tile
        if prefetch:
            if addr:
                _load_full(x, n, cuda.blockIdx.x * WPB + w, ntiles, tile_vals, lane, nxt)
            else:
                _load_tile(x, n, cuda.blockIdx.x * WPB + w, ntiles, tile_vals, lane, nxt)
        for first in range(cuda.blockIdx.x * WPB, ntiles, stride):
            tile = first + w
            s0 = np.int64(tile) * tile_vals
            if prefetch and addr:
                for j in range(C):
                    sx[wu, lu + np.uint32(j * (WARP + 1))] = nxt[j]
                _load_full(x, n, tile + stride, ntiles, tile_vals, lane, nxt)
            elif prefetch:
                for j in range(C):
                    li = j * WARP + lane
                    sx[w, li + (li >> 5)] = nxt[j]
                _load_tile(x, n, tile + stride, ntiles, tile_vals, lane, nxt)
            elif addr:
                _load_full(x, n, tile, ntiles, tile_vals, lane, nxt)
                for j in range(C):
                    sx[wu, lu + np.uint32(j * (WARP + 1))] = nxt[j]
            else:
                for j in range(C):
                    li = j * WARP + lane
                    val = np.float32(0.0)
                    if tile < ntiles and li < tile_vals and s0 + li < n:
                        val = x[s0 + li]
                    sx[w, li + (li >> 5)] = val
            sync()
            i0 = s0 + c0
            mn = np.float32(np.inf)
            mx = np.float32(-np.inf)
            live = tile < ntiles and team < per_tile
            cnt = np.int32(min(max(n - i0, 0), C)) if live else np.int32(0)
            lanebad = 0
            for k in range(C):
                li = c0 + k
                val = sx[wu, ru + np.uint32(k)] if addr else sx[w, li + (li >> 5)]
                v[k] = val
                here = k < cnt
                ok = here and abs(val) <= _FMAX
                a = val if ok else np.float32(np.inf)
                b = val if ok else np.float32(-np.inf)
                mn = a if a < mn else mn
                mx = b if b > mx else mx
                lanebad += 1 if here and not ok else 0
            nonfinite += lanebad
            mn, mx = _team_range(smn, smx, w, lane, team, tl, team_size, per_tile, mn, mx)
            g = np.int64(tile) * per_tile + team
            if live and tl == 0 and g < ngroups:
                meta[g, 0] = mn
                meta[g, 1] = mx
            mn64 = np.float64(mn)
            rng = np.float64(mx) - mn64
            sc = SCALE / rng if rng > 0.0 else 0.0
            key = _key32(seed, i0 >> 32)
            lo = np.uint32(i0 & 0xFFFFFFFF)
            acc = WT(0)
            if fastpath and cnt == C and lanebad == 0:
                for k in range(C):
                    acc |= WT(_code(v[k], k, mn64, sc, lo, key)) << WT(k * bits)
            else:
                for k in range(C):
                    val = v[k]
                    ok = k < cnt and abs(val) <= _FMAX
                    acc |= WT(_code(val if ok else mn, k, mn64, sc, lo, key)) << WT(k * bits)
            if wordstore:
                if live and g < ngroups:
                    payload.view(WT)[i0 // C] = acc
            else:
                for b in range(CB):
                    sb[w, lane * CB + b] = np.uint8((acc >> WT(8 * b)) & WT(0xFF))
            if want_positive:
                _positive_bits(v, cnt, i0, positive)
            if not wordstore:  # (a word store reads no shared memory; the next tile's barrier suffices)
                sync()
            if not wordstore:
                b0 = s0 * bits // 8
                for m in range(CB):
                    bi = m * WARP + lane
                    if tile < ntiles and bi < tile_vals * bits // 8 and b0 + bi < nbytes:
                        payload[b0 + bi] = sb[w, bi]
        if nonfinite:
            cuda.atomic.add(bad, 0, 1)

    return encode
