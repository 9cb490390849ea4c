"""Numba kernels of the ``errorbound`` codec: one per-group algorithm, two targets.

The per-group steps (plan, pack, unpack) are written once, as plain Python, in
:mod:`memctl.codecs.errorbound._ops`, whose :func:`make_group_ops` compiles them for a
target: ``numba.njit`` for the CPU kernels (:mod:`memctl.codecs.errorbound._cpu`),
``numba.cuda.jit(device=True)`` for the CUDA ones in :mod:`memctl.codecs.errorbound._cuda`.
The CPU and CUDA kernels therefore run the same statements; the PyTorch reference in
:mod:`memctl.codecs.errorbound._reference` is written independently and the tests hold
all three to byte-identical output. The format and the arithmetic are described in
NOTE [ errorbound format ] and NOTE [ errorbound arithmetic ] in
:mod:`memctl.codecs.errorbound`.

Nothing here imports Numba until :func:`cpu_kernels` or :func:`cuda_kernels` is first
called. The CPU loops are cached on disk (NOTE [ Kernel cache ] in
:mod:`memctl.codecs._numba`); tensors below ``SERIAL_BELOW`` values run them serially.

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

__all__ = ["SERIAL_BELOW", "Kernels", "cpu_kernels", "cpu_serial_kernels", "cuda_kernels", "run"]


class Kernels(NamedTuple):
    """Launchable kernels of one target (see the ``_make_*_kernels`` functions)."""

    plan: Any
    pack: Any
    unpack: Any


# Below this many values the serial loops run: a parallel launch costs more than the work,
# and far more while other processes keep the cores busy.
SERIAL_BELOW = 1 << 15


@functools.cache
def cpu_kernels() -> Kernels:
    """The parallel CPU loops (the serial ones in :func:`cpu_serial_kernels`), from :mod:`._cpu`.

    The first call in a process compiles them when Numba's cache does not hold them yet,
    and says so in the log (NOTE [ Kernel cache ] in :mod:`memctl.codecs._numba`).
    """
    from numba import types as nt

    from memctl.codecs import _numba
    from memctl.codecs.errorbound import _cpu

    f32, i16, i32, i64, u8 = (nt.float32[::1], nt.int16[::1], nt.int32[::1], nt.int64[::1], nt.uint8[::1])
    f64, n64 = nt.float64, nt.int64
    meta = (u8, i32, f32)
    plan = [(f32, n64, n64, f64, f64, f64, f64, f64, n64, *meta, i64)]
    pack = [(f32, raw, n64, n64, n64, *meta, i64, u8) for raw in (i16, i32)]
    unpack = [(u8, n64, n64, n64, n64, *meta, i64, f32)]
    _numba.prepare("errorbound", [
        (_cpu.plan, plan), (_cpu.plan_serial, plan), (_cpu.pack, pack), (_cpu.pack_serial, pack),
        (_cpu.unpack, unpack), (_cpu.unpack_serial, unpack),
    ])
    return Kernels(_cpu.plan, _cpu.pack, _cpu.unpack)


@functools.cache
def cpu_serial_kernels() -> Kernels:
    """The serial CPU loops (same bytes as :func:`cpu_kernels`), for small tensors."""
    cpu_kernels()
    from memctl.codecs.errorbound import _cpu

    return Kernels(_cpu.plan_serial, _cpu.pack_serial, _cpu.unpack_serial)


def run(parallel: Any, serial: Any, n: int, *args: Any) -> None:
    """``serial(*args)`` below :data:`SERIAL_BELOW` values, else ``parallel`` under the thread budget."""
    if n < SERIAL_BELOW:
        serial(*args)
        return
    from memctl.codecs import _numba

    _numba.launch(parallel, serial, *args)


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
