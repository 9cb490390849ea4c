"""Block-per-group CUDA kernels of ``quantize``, which run groups larger than a warp's tile
(NOTE [ Quantize CUDA kernels ] in ``_kernels``; smaller groups run ``_cuda_teams``).

This module imports ``numba.cuda`` at its top, so it is imported only on first use (by
:func:`memctl.codecs.quantize._kernels.cuda_kernels`); the kernels refer to ``cuda`` as a
module global, which is what Numba's simulator swaps for its fake module. Decorating
compiles nothing: each kernel compiles on its first launch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda as _numba_cuda

from memctl.codecs import _rng

cuda: Any = _numba_cuda  # the module itself: the simulator swaps globals that are numba.cuda

__all__ = ["TPB", "decode", "encode"]

TPB = 64  # threads per block; a power of two for the tree reduction
_FMAX = np.float32(3.4028234663852886e38)

_lowbias32 = cuda.jit(device=True)(_rng.lowbias32_numba)


@cuda.jit(device=True)
def _key(seed: Any, hi: Any) -> Any:
    m = np.uint64(0xFFFFFFFF)
    return _lowbias32(np.uint64(seed) ^ ((np.uint64(hi) * np.uint64(0x9E3779B9)) & m))


@cuda.jit(fastmath=False)
def encode(x: Any, n: Any, group: Any, bits: Any, seed: Any, meta: Any, payload: Any, bad: Any) -> None:
    """One block per group: shared-memory min/max, then one output byte per thread."""
    smin = cuda.shared.array(TPB, np.float32)
    smax = cuda.shared.array(TPB, np.float32)
    tid = cuda.threadIdx.x
    ngroups = meta.shape[0]
    big = (1 << bits) - 1
    per = 8 // bits
    gbytes = group * bits // 8
    m32 = np.uint64(0xFFFFFFFF)
    for g in range(cuda.blockIdx.x, ngroups, cuda.gridDim.x):
        s = g * group
        e = min(s + group, n)
        mn = np.float32(np.inf)
        mx = np.float32(-np.inf)
        nonfinite = 0
        for i in range(s + tid, e, TPB):
            v = x[i]
            if abs(v) <= _FMAX:
                mn = v if v < mn else mn
                mx = v if v > mx else mx
            else:
                nonfinite += 1
        if nonfinite:  # adding 1 (not the count) keeps ``bad`` from wrapping to 0
            cuda.atomic.add(bad, 0, 1)
        smin[tid] = mn
        smax[tid] = mx
        cuda.syncthreads()
        stride = TPB // 2
        while stride > 0:
            if tid < stride:
                a = smin[tid + stride]
                b = smax[tid + stride]
                if a < smin[tid]:
                    smin[tid] = a
                if b > smax[tid]:
                    smax[tid] = b
            cuda.syncthreads()
            stride //= 2
        mn = smin[0]
        mx = smax[0]
        cuda.syncthreads()  # every thread has read the result before the next group reuses smin
        if mn > mx:  # no finite value in the group
            mn = np.float32(0.0)
            mx = np.float32(0.0)
        mn = mn + np.float32(0.0)  # -0.0 -> +0.0
        mx = mx + np.float32(0.0)
        if tid == 0:
            meta[g, 0] = mn
            meta[g, 1] = mx
        mn64 = np.float64(mn)
        rng = np.float64(mx) - mn64
        sc = (np.float64(big) * 16777216.0) / rng if rng > 0.0 else 0.0
        hi = s >> 32
        key = _key(seed, hi)
        for k in range(tid, gbytes, TPB):
            acc = 0
            for j in range(per):
                i = s + k * per + j
                if i < e:
                    v = x[i]
                    if abs(v) <= _FMAX:
                        kk = key if (i >> 32) == hi else _key(seed, i >> 32)
                        t = np.int64((np.float64(v) - mn64) * sc)
                        r = np.int64(_lowbias32((np.uint64(i) & m32) ^ kk) >> np.uint64(8))
                        q = min((t + r) >> 24, big)
                        acc |= q << (j * bits)
            payload[g * gbytes + k] = np.uint8(acc)


@cuda.jit(fastmath=False)
def decode(
    payload: Any, meta: Any, n: Any, group: Any, bits: Any, out: Any, mask: Any, masked: Any, floor: Any
) -> None:
    """One block per group: a shared table of the 2**bits levels, then one input byte per thread.

    With ``masked``, each value also takes its bit of ``mask`` (NOTE [ Masked decode ]).
    """
    lv = cuda.shared.array(256, np.float32)
    tid = cuda.threadIdx.x
    ngroups = meta.shape[0]
    big = (1 << bits) - 1
    per = 8 // bits
    gbytes = group * bits // 8
    for g in range(cuda.blockIdx.x, ngroups, cuda.gridDim.x):
        mn = meta[g, 0]
        mx = meta[g, 1]
        mn64 = np.float64(mn)
        rng = np.float64(mx) - mn64
        for q in range(tid, big + 1, TPB):
            y = np.float32(mn64 + (np.float64(q) * rng) / np.float64(big))
            y = mn if y < mn else y
            y = mx if y > mx else y
            lv[q] = y
        cuda.syncthreads()
        s = g * group
        e = min(s + group, n)
        for k in range(tid, gbytes, TPB):
            b = np.int64(payload[g * gbytes + k])
            for j in range(per):
                i = s + k * per + j
                if i < e:
                    v = lv[(b >> (j * bits)) & big]
                    if masked:
                        v = (floor if v < floor else v) if (mask[i >> 3] >> (i & 7)) & 1 else np.float32(0.0)
                    out[i] = v
        cuda.syncthreads()  # the table is rebuilt for the next group
