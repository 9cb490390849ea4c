"""Numba kernels of the ``errorbound`` codec: one per-group algorithm, two targets.

The per-group steps (plan, pack, unpack) are written once, as plain Python, inside
:func:`make_group_ops`, which compiles them with whichever decorator it is given:
``numba.njit`` for the CPU kernels here, ``numba.cuda.jit(device=True)`` for the CUDA
ones in :mod:`memctl.codecs.errorbound._cuda`.
The CPU and CUDA kernels therefore run the same statements; the PyTorch reference in
:mod:`memctl.codecs.errorbound._reference` is written independently and the tests hold
all three to byte-identical output. The format and the arithmetic are described in
NOTE [ errorbound format ] and NOTE [ errorbound arithmetic ] in
:mod:`memctl.codecs.errorbound`.

Nothing here imports Numba until :func:`cpu_kernels` or :func:`cuda_kernels` is first
called; both build (compile) once per process.

NOTE [ errorbound parallelism ]
Encoding runs one work item per group (a ``prange`` iteration on the CPU, a CUDA thread
on the GPU): pass 1 finds the group's bound, step, codes, bit width and mode; a device
``cumsum`` turns sizes into payload offsets; pass 2 recomputes the codes and ORs the
group's bits into the zeroed payload (groups are byte-aligned, so no two work items
touch the same byte). On the GPU that is ``ceil(n / G)`` threads, few for small
tensors; a block-per-group encoder (shared-memory reductions, a block scan for sparse
ranks) would use the device better and is the natural next step. Decoding on the GPU
runs one thread per value (a sparse value finds its rank by counting the bitmap's bits
before it); on the CPU one ``prange`` iteration per group reads the group sequentially.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from memctl.codecs.errorbound._ops import make_group_ops

__all__ = ["Kernels", "cpu_kernels", "cuda_kernels"]


class Kernels(NamedTuple):
    """Launchable kernels of one target (see the ``_make_*_kernels`` functions)."""

    plan: Any
    pack: Any
    unpack: Any


@functools.cache
def cpu_kernels() -> Kernels:
    """The ``@njit(parallel=True)`` kernels (compiled on first launch, per argument types)."""
    import numba

    ops = make_group_ops(numba.njit(fastmath=False))
    plan_group, pack_group, unpack_group = ops.plan, ops.pack, ops.unpack_group

    @numba.njit(parallel=True, fastmath=False, nogil=True)
    def plan(
        x: Any, n: Any, gs: Any, e: Any, cast_rel: Any, cast_min: Any, shrink: Any, vmax: Any,
        raw_width: Any, mode: Any, qmin: Any, step: Any, size: Any,
    ) -> None:
        for g in numba.prange(mode.shape[0]):
            plan_group(x, g, n, gs, e, cast_rel, cast_min, shrink, vmax, raw_width, mode, qmin, step, size)

    @numba.njit(parallel=True, fastmath=False, nogil=True)
    def pack(
        x: Any, xraw: Any, n: Any, gs: Any, raw_width: Any,
        mode: Any, qmin: Any, step: Any, offset: Any, payload: Any,
    ) -> None:
        for g in numba.prange(mode.shape[0]):
            pack_group(x, xraw, g, n, gs, raw_width, mode, qmin, step, offset, payload)

    @numba.njit(parallel=True, fastmath=False, nogil=True)
    def unpack(
        payload: Any, n: Any, gs: Any, exp_bits: Any, man_bits: Any,
        mode: Any, qmin: Any, step: Any, offset: Any, out: Any,
    ) -> None:
        for g in numba.prange(mode.shape[0]):
            unpack_group(payload, g, n, gs, exp_bits, man_bits, mode, qmin, step, offset, out)

    return Kernels(plan, pack, unpack)


@functools.cache
def cuda_kernels() -> Kernels:
    """The Numba-CUDA kernels (``fastmath=False``), from :mod:`memctl.codecs.errorbound._cuda`.

    On a real GPU the first call compiles them and raises the toolchain's error when NVVM
    or NVRTC is missing; in the simulator it only wraps them.
    """
    from memctl.codecs._backend import cuda

    cuda()  # a clear CudaUnavailableError when numba.cuda cannot be imported
    from memctl.codecs.errorbound import _cuda as kernels

    return Kernels(kernels.plan, kernels.pack, kernels.unpack)
