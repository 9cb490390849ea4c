"""Numba-CUDA kernels of the ``errorbound`` codec.

Importing this module imports ``numba.cuda`` and, on a real GPU, compiles the kernels:
only :func:`memctl.codecs.errorbound._kernels.cuda_kernels` imports it, on first use.
``cuda`` must be a module global here: the CUDA simulator swaps the module globals of a
kernel that are ``numba.cuda`` for its fake module (NOTE [ CUDA simulator ]).
The per-group steps are shared with the CPU kernels (:func:`make_group_ops`); see NOTE
[ errorbound parallelism ] for how work is spread over threads.
"""

from __future__ import annotations

from typing import Any

from numba import cuda as _numba_cuda

from memctl.codecs.errorbound._ops import cuda_signatures, make_group_ops

__all__ = ["pack", "plan", "unpack"]

cuda: Any = _numba_cuda  # the module itself (see above), typed loosely for mypy

_ops = make_group_ops(cuda.jit(device=True, fastmath=False))
_plan_group = _ops.plan
_pack_group = _ops.pack
_unpack_value = _ops.unpack_value
_sigs = cuda_signatures()


def _plan(
    x: Any, n: Any, gs: Any, e: Any, cast_rel: Any, cast_min: Any, shrink: Any, vmax: Any,
    raw_width: Any, mode: Any, qmin: Any, step: Any, size: Any,
) -> None:
    """Pass 1, one thread per group."""
    g = cuda.grid(1)
    if g < mode.shape[0]:
        _plan_group(x, g, n, gs, e, cast_rel, cast_min, shrink, vmax, raw_width, mode, qmin, step, size)


def _pack(
    x: Any, xraw: Any, n: Any, gs: Any, raw_width: Any,
    mode: Any, qmin: Any, step: Any, offset: Any, payload: Any,
) -> None:
    """Pass 2, one thread per group."""
    g = cuda.grid(1)
    if g < mode.shape[0]:
        _pack_group(x, xraw, g, n, gs, raw_width, mode, qmin, step, offset, payload)


def _unpack(
    payload: Any, n: Any, gs: Any, exp_bits: Any, man_bits: Any,
    mode: Any, qmin: Any, step: Any, offset: Any, out: Any,
) -> None:
    """Decoding, one thread per value."""
    i = cuda.grid(1)
    if i < n:
        _unpack_value(payload, i, n, gs, exp_bits, man_bits, mode, qmin, step, offset, out)


plan = cuda.jit(_sigs["plan"], fastmath=False)(_plan)
pack = cuda.jit(_sigs["pack"], fastmath=False)(_pack)
unpack = cuda.jit(_sigs["unpack"], fastmath=False)(_unpack)
