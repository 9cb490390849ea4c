"""Warp-team CUDA kernels of the ``quantize`` codec (NOTE [ Quantize CUDA kernels ] in ``_kernels``).

Built per ``(bits, chunk)`` by :func:`team_kernels` on first use, so the bit width and the
values per lane are compile-time constants (the loops over them unroll and the lane's values
stay in registers). This module imports ``numba.cuda`` at its top and is imported only on
first use; the kernels refer to ``cuda`` as a module global, which is what Numba's simulator
swaps for its fake module. Building compiles nothing: each kernel compiles on its first launch.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import cuda as _numba_cuda

cuda: Any = _numba_cuda  # the module itself: the simulator swaps globals that are numba.cuda

__all__ = [
    "BLOCKS_PER_SM", "TEAM_TPB", "WARPS_PER_BLOCK", "chunk_for", "positive_writer", "team_kernels",
    "team_range", "tile_loader", "uses_teams",
]

WARP = 32
WARPS_PER_BLOCK = 4
TEAM_TPB = WARP * WARPS_PER_BLOCK  # threads per block
#: Blocks per multiprocessor of the grid, and the kernels' launch bound: 4 blocks of 128
#: threads stay resident together (at most 128 registers a thread), so the grid-stride loop
#: runs in one wave and no block starts late.
BLOCKS_PER_SM = 4
_FMAX = np.float32(3.4028234663852886e38)
_M32 = np.uint64(0xFFFFFFFF)


def chunk_for(group: int, bits: int) -> int:
    """Values per lane: 16 for 1 and 2 bits when ``group`` is a multiple of 16, else 8.

    A lane's run of values never crosses a group boundary. At 4 and 8 bits, 16 values a lane
    need more than the 128 registers of ``BLOCKS_PER_SM`` resident blocks (ptxas spills).
    """
    return 16 if bits <= 2 and group % 16 == 0 else 8


def uses_teams(group: int, bits: int) -> bool:
    """Whether ``group`` fits one warp (``group <= 32 * chunk``): the team kernels run it."""
    return group <= WARP * chunk_for(group, bits)


@cuda.jit(device=True)
def _mix32(x: Any) -> Any:
    """``lowbias32`` on a uint32 (NOTE [ Counter-based RNG ]): 32-bit multiplies, written as
    masked 64-bit products so that the simulator's NumPy scalars never overflow."""
    x = np.uint32(x ^ (x >> np.uint32(16)))
    x = np.uint32((np.uint64(x) * np.uint64(0x7FEB352D)) & _M32)
    x = np.uint32(x ^ (x >> np.uint32(15)))
    x = np.uint32((np.uint64(x) * np.uint64(0x846CA68B)) & _M32)
    return np.uint32(x ^ (x >> np.uint32(16)))


def _mix32_wrapping(x: Any) -> Any:
    """``lowbias32`` on a uint32 for a real GPU: each product truncated to 32 bits, which NVVM
    compiles to 32-bit multiplies (the masked form of :func:`_mix32` stays in 64-bit registers).
    As Python on NumPy scalars the products would overflow with a warning: the simulator runs
    :func:`_mix32`, the same function of ``x``."""
    x = np.uint32(x ^ (x >> np.uint32(16)))
    x = np.uint32(x * np.uint32(0x7FEB352D))
    x = np.uint32(x ^ (x >> np.uint32(15)))
    x = np.uint32(x * np.uint32(0x846CA68B))
    return np.uint32(x ^ (x >> np.uint32(16)))


_mix32_gpu = cuda.jit(device=True)(_mix32_wrapping)


@cuda.jit(device=True)
def _key32(seed: Any, hi: Any) -> Any:
    """``key(seed, hi)`` of NOTE [ Counter-based RNG ] as a uint32."""
    return _mix32(np.uint32((np.uint64(seed) ^ ((np.uint64(hi) * np.uint64(0x9E3779B9)) & _M32)) & _M32))


@cuda.jit(device=True)
def _level(mn: Any, mx: Any, mn64: Any, rng: Any, q: Any, big: Any, masked: Any, floor: Any) -> Any:
    """Level ``q`` of a group: ``float32(mn + (q * R) / B)`` clamped to ``[mn, mx]``, then raised
    to ``floor`` when masked (the floor of a level is the floor of its values)."""
    y = np.float32(mn64 + (np.float64(q) * rng) / np.float64(big))
    y = mn if y < mn else y
    y = mx if y > mx else y
    if masked:
        y = floor if y < floor else y
    return y


@functools.cache
def team_kernels(bits: int, chunk: int, simulated: bool) -> tuple[Any, Any]:
    """``(encode, decode)`` for ``bits`` per value and ``chunk`` values per lane.

    ``simulated``: Numba's simulator has no ``syncwarp``; there the warp barrier is a block
    barrier, which every thread reaches equally often (the loops are uniform over the block).
    Other builds of the encode, for benchmarks: ``_cuda_variants.team_kernels`` (NOTE [ Team
    kernel variants ]).
    """
    return _build_encode(bits, chunk, simulated), _build_decode(bits, chunk, simulated)


def _warp_sync(simulated: bool) -> Callable[[], None]:
    if simulated:
        def sync() -> None:
            cuda.syncthreads()
    else:
        def sync() -> None:
            cuda.syncwarp()
    return cuda.jit(device=True)(sync)


def _kernel_options(simulated: bool) -> dict[str, Any]:
    """``fastmath=False`` (NOTE [ Quantize arithmetic ]) and, for a real GPU, the launch bound
    of ``BLOCKS_PER_SM`` (the simulator, and Numba-CUDA releases before launch bounds, take none)."""
    if simulated or "launch_bounds" not in inspect.signature(cuda.jit).parameters:
        return {"fastmath": False}
    return {"fastmath": False, "launch_bounds": (TEAM_TPB, BLOCKS_PER_SM)}


@functools.cache
def tile_loader(chunk: int, simulated: bool) -> Any:
    """``load_tile(x, n, tile, ntiles, tile_vals, lane, dest)``: lane ``lane``'s ``chunk`` values
    of warp tile ``tile`` (value ``j * 32 + lane`` in ``dest[j]``); 0 past the tile, the tensor
    or the last tile. (``simulated`` keys the cache: a device function of one target only.)"""
    C = chunk

    @cuda.jit(device=True)
    def load_tile(x: Any, n: Any, tile: Any, ntiles: Any, tile_vals: Any, lane: Any, dest: Any) -> None:
        s0 = np.int64(tile) * tile_vals
        for j in range(C):
            li = j * WARP + lane
            val = np.float32(0.0)
            if tile < ntiles and li < tile_vals and s0 + li < n:
                val = x[s0 + li]
            dest[j] = val

    return load_tile


@functools.cache
def team_range(simulated: bool) -> Any:
    """``team_range(smn, smx, w, lane, team, tl, team_size, per_tile, mn, mx) -> (mn, mx)``: the
    minimum and maximum of a team's lanes (each lane's own in ``mn``, ``mx``), by a tree over the
    lanes in the warp's shared rows ``smn[w]``, ``smx[w]``; (0, 0) where no value was finite, and
    -0.0 as +0.0. Every lane of the warp calls it (it holds warp barriers)."""
    sync = _warp_sync(simulated)

    @cuda.jit(device=True)
    def team_range(smn: Any, smx: Any, w: Any, lane: Any, team: Any, tl: Any, team_size: Any,
                   per_tile: Any, mn: Any, mx: Any) -> Any:
        smn[w, lane] = mn
        smx[w, lane] = mx
        sync()
        step = 1
        while step < team_size:
            if team < per_tile and tl % (2 * step) == 0 and tl + step < team_size:
                a = smn[w, lane + step]
                b = smx[w, lane + step]
                mn = a if a < mn else mn
                mx = b if b > mx else mx
                smn[w, lane] = mn
                smx[w, lane] = mx
            sync()
            step *= 2
        mn = smn[w, team * team_size]
        mx = smx[w, team * team_size]
        if mn > mx:  # no finite value in the group
            mn = np.float32(0.0)
            mx = np.float32(0.0)
        return mn + np.float32(0.0), mx + np.float32(0.0)  # -0.0 -> +0.0

    return team_range


@functools.cache
def positive_writer(chunk: int, simulated: bool) -> Any:
    """``positive_bits(v, cnt, i0, positive)``: the bit map of which of the lane's first ``cnt``
    values (of ``chunk``, in ``v``) are above zero, into ``positive`` from byte ``i0 / 8``."""
    C = chunk

    @cuda.jit(device=True)
    def positive_bits(v: Any, cnt: Any, i0: Any, positive: Any) -> None:
        for m in range(C // 8):
            if 8 * m < cnt:
                acc = 0
                for j in range(8):
                    k = 8 * m + j
                    if k < cnt and v[k] > np.float32(0.0):
                        acc |= 1 << j
                positive[(i0 >> 3) + m] = np.uint8(acc)

    return positive_bits


def _build_encode(bits: int, chunk: int, simulated: bool) -> Any:
    C = chunk
    P = 8 // bits  # values per byte
    CB = C * bits // 8  # payload bytes per lane
    BIG = (1 << bits) - 1
    WPB = WARPS_PER_BLOCK
    XS = C * (WARP + 1)  # a warp's tile of 32 * C values, one pad word per 32 (conflict-free)
    SB = WARP * CB  # a warp tile's payload bytes
    SCALE = np.float64(BIG) * 16777216.0
    sync = _warp_sync(simulated)
    mix = _mix32 if simulated else _mix32_gpu
    _load_tile = tile_loader(C, simulated)
    _team_range = team_range(simulated)
    _positive_bits = positive_writer(C, simulated)

    @cuda.jit(**_kernel_options(simulated))
    def encode(
        x: Any, n: Any, group: Any, seed: Any, meta: Any, payload: Any, bad: Any, positive: Any,
        want_positive: Any,
    ) -> None:
        """Each warp encodes whole groups: a team of ``group / C`` lanes per group, ``C`` values a lane."""
        sx = cuda.shared.array((WPB, XS), np.float32)
        smn = cuda.shared.array((WPB, WARP), np.float32)
        smx = cuda.shared.array((WPB, WARP), np.float32)
        sb = cuda.shared.array((WPB, SB), np.uint8)
        v = cuda.local.array(C, np.float32)
        nxt = cuda.local.array(C, np.float32)
        tid = cuda.threadIdx.x
        w = tid // WARP
        lane = tid % WARP
        team_size = group // C  # lanes per group, 1..32
        per_tile = WARP // team_size  # groups per warp tile
        team = lane // team_size
        tl = lane - team * team_size
        tile_vals = per_tile * group
        ngroups = meta.shape[0]
        ntiles = (ngroups + per_tile - 1) // per_tile
        nbytes = payload.shape[0]
        c0 = lane * C  # the lane's first value in the tile
        nonfinite = 0
        # Every warp of the block runs the same number of iterations (barriers stay uniform).
        stride = cuda.gridDim.x * WPB
        _load_tile(x, n, cuda.blockIdx.x * WPB + w, ntiles, tile_vals, lane, nxt)
        for first in range(cuda.blockIdx.x * WPB, ntiles, stride):
            tile = first + w
            s0 = np.int64(tile) * tile_vals
            # (1) the tile's values, loaded coalesced one iteration ahead, into the warp's shared
            # tile; then the next tile's loads are issued, to be in flight while this one is coded
            for j in range(C):
                li = j * WARP + lane
                sx[w, li + (li >> 5)] = nxt[j]
            _load_tile(x, n, tile + stride, ntiles, tile_vals, lane, nxt)
            sync()
            # (2) the lane's C consecutive values (one group), min/max over the finite ones
            i0 = s0 + c0
            mn = np.float32(np.inf)
            mx = np.float32(-np.inf)
            live = tile < ntiles and team < per_tile
            cnt = np.int32(min(max(n - i0, 0), C)) if live else np.int32(0)  # the lane's values
            for k in range(C):
                li = c0 + k
                val = sx[w, li + (li >> 5)]
                v[k] = val
                if k < cnt:
                    if abs(val) <= _FMAX:
                        mn = val if val < mn else mn
                        mx = val if val > mx else mx
                    else:
                        nonfinite += 1
            # (3) the team's min/max: a tree over its lanes in shared memory
            mn, mx = _team_range(smn, smx, w, lane, team, tl, team_size, per_tile, mn, mx)
            g = np.int64(tile) * per_tile + team
            if live and tl == 0 and g < ngroups:
                meta[g, 0] = mn
                meta[g, 1] = mx
            # (4) codes from registers, packed into the warp's shared bytes
            mn64 = np.float64(mn)
            rng = np.float64(mx) - mn64
            sc = SCALE / rng if rng > 0.0 else 0.0
            key = _key32(seed, i0 >> 32)  # a chunk never crosses a multiple of 2**32
            lo = np.uint32(i0 & 0xFFFFFFFF)
            for b in range(CB):
                acc = 0
                for p in range(P):
                    k = b * P + p
                    val = v[k]
                    if k < cnt and abs(val) <= _FMAX:
                        # T = trunc((x - mn) * s) < 2**32 (it is at most B * 2**24 plus rounding),
                        # so (T + r) >> 24 is computed in 32 bits as T's top byte plus a carry
                        t = np.uint32((np.float64(val) - mn64) * sc)
                        r = np.uint32(mix(np.uint32(lo + np.uint32(k)) ^ key) >> np.uint32(8))
                        carry = np.uint32((np.uint32(t & np.uint32(0xFFFFFF)) + r) >> np.uint32(24))
                        q = np.uint32(np.uint32(t >> np.uint32(24)) + carry)
                        acc |= int(q if q < BIG else BIG) << (p * bits)
                sb[w, lane * CB + b] = np.uint8(acc)
            if want_positive:
                _positive_bits(v, cnt, i0, positive)
            sync()
            # (5) coalesced byte stores of the tile (padding codes of the last group included)
            b0 = s0 * bits // 8
            for m in range(CB):
                bi = m * WARP + lane
                if tile < ntiles and bi < tile_vals * bits // 8 and b0 + bi < nbytes:
                    payload[b0 + bi] = sb[w, bi]
        if nonfinite:  # one atomic per thread that saw any; adding 1 keeps the count from wrapping
            cuda.atomic.add(bad, 0, 1)

    return encode


def _build_decode(bits: int, chunk: int, simulated: bool) -> Any:
    C = chunk
    P = 8 // bits
    CB = C * bits // 8
    BIG = (1 << bits) - 1
    WPB = WARPS_PER_BLOCK
    XS = C * (WARP + 1)
    MB = C // 8  # mask bytes per lane
    sync = _warp_sync(simulated)

    @cuda.jit(device=True)
    def _fetch(
        payload: Any, meta: Any, n: Any, group: Any, mask: Any, masked: Any, tile: Any, ntiles: Any,
        per_tile: Any, team: Any, c0: Any, codes: Any, mbits: Any,
    ) -> Any:
        """The lane's inputs of warp tile ``tile``: its payload bytes into ``codes``, its mask
        bytes into ``mbits``; returns ``(min, max, whether the lane has values there)``."""
        s0 = np.int64(tile) * (per_tile * group)
        i0 = s0 + c0
        g = np.int64(tile) * per_tile + team
        ok = tile < ntiles and team < per_tile and g < meta.shape[0] and i0 < n
        mn = np.float32(0.0)
        mx = np.float32(0.0)
        for b in range(CB):
            codes[b] = 0
        for m in range(MB):
            mbits[m] = 0
        if ok:
            mn = meta[g, 0]
            mx = meta[g, 1]
            b0 = i0 * bits // 8
            for b in range(CB):
                codes[b] = np.int32(payload[b0 + b])
            if masked:
                for m in range(MB):
                    if i0 + 8 * m < n:
                        mbits[m] = np.int32(mask[(i0 >> 3) + m])
        return mn, mx, ok

    @cuda.jit(**_kernel_options(simulated))
    def decode(
        payload: Any, meta: Any, n: Any, group: Any, out: Any, mask: Any, masked: Any, floor: Any
    ) -> None:
        """Each lane expands ``C`` consecutive values of one group; the warp stores them coalesced.

        With ``masked``, each value also takes its bit of ``mask`` (NOTE [ Masked decode ]). A
        tile's inputs are loaded one iteration ahead, while the previous tile is stored.
        """
        sx = cuda.shared.array((WPB, XS), np.float32)
        codes = cuda.local.array(CB, np.int32)
        mbits = cuda.local.array(MB, np.int32)
        tid = cuda.threadIdx.x
        w = tid // WARP
        lane = tid % WARP
        team_size = group // C
        per_tile = WARP // team_size
        team = lane // team_size
        tile_vals = per_tile * group
        ngroups = meta.shape[0]
        ntiles = (ngroups + per_tile - 1) // per_tile
        c0 = lane * C
        stride = cuda.gridDim.x * WPB
        mn, mx, ok = _fetch(
            payload, meta, n, group, mask, masked, cuda.blockIdx.x * WPB + w, ntiles, per_tile, team, c0,
            codes, mbits,
        )
        for first in range(cuda.blockIdx.x * WPB, ntiles, stride):
            tile = first + w
            s0 = np.int64(tile) * tile_vals
            if ok:
                mn64 = np.float64(mn)
                rng = np.float64(mx) - mn64
                # bits <= 2: the 2 or 4 levels once per lane, exactly the reference's expression;
                # bits >= 4: the level of each value by the same expression (no table to build)
                l0 = _level(mn, mx, mn64, rng, 0, BIG, masked, floor)
                l1 = _level(mn, mx, mn64, rng, 1, BIG, masked, floor)
                l2 = l1
                l3 = l1
                if BIG == 3:
                    l2 = _level(mn, mx, mn64, rng, 2, BIG, masked, floor)
                    l3 = _level(mn, mx, mn64, rng, 3, BIG, masked, floor)
                for b in range(CB):
                    code = codes[b]
                    for p in range(P):
                        k = b * P + p
                        q = (code >> (p * bits)) & BIG
                        if BIG == 1:
                            y = l1 if q else l0
                        elif BIG == 3:
                            y = (l3 if q == 3 else l2) if q >= 2 else (l1 if q == 1 else l0)
                        else:
                            y = _level(mn, mx, mn64, rng, q, BIG, masked, floor)
                        if masked and not (mbits[k >> 3] >> (k & 7)) & 1:
                            y = np.float32(0.0)
                        li = c0 + k
                        sx[w, li + (li >> 5)] = y
            sync()
            mn, mx, ok = _fetch(
                payload, meta, n, group, mask, masked, tile + stride, ntiles, per_tile, team, c0, codes, mbits
            )
            for j in range(C):
                li = j * WARP + lane
                if tile < ntiles and li < tile_vals and s0 + li < n:
                    out[s0 + li] = sx[w, li + (li >> 5)]
            sync()  # every lane has stored before the next tile overwrites the shared tile

    return decode
