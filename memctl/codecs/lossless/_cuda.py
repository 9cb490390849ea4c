"""CUDA kernels of the ``lossless`` codec (bit-packing of bool masks, see ``_lossless_kernels``).

Imports ``numba.cuda`` at its top, so it is imported only on first use; the kernels refer
to ``cuda`` as a module global, which Numba's simulator swaps for its fake module.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda as _numba_cuda

cuda: Any = _numba_cuda  # the module itself: the simulator swaps globals that are numba.cuda

__all__ = ["pack", "unpack"]


@cuda.jit(fastmath=False)
def pack(bits: Any, n: Any, out: Any) -> None:
    """One thread per output byte: 8 consecutive bools (0/1 bytes), LSB first."""
    k = cuda.grid(1)
    if k < out.size:
        acc = np.int32(0)
        for j in range(8):
            i = 8 * k + j
            if i < n:
                acc |= np.int32(bits[i]) << j
        out[k] = np.uint8(acc)


@cuda.jit(fastmath=False)
def unpack(payload: Any, n: Any, out: Any) -> None:
    """One thread per value."""
    i = cuda.grid(1)
    if i < n:
        out[i] = np.uint8((np.int32(payload[i >> 3]) >> (i & 7)) & 1)
