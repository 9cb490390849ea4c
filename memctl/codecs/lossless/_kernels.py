"""Numba kernels of the ``lossless`` codec: packing bool masks at one bit per value.

Byte ``k`` of the payload holds values ``8k .. 8k+7``, value ``8k + j`` in bit ``j``
(LSB first); the bits past the last value are 0. The CPU kernels (in ``_cpu``, cached on
disk) run a ``prange`` over chunks of output bytes, or serially for masks below
``SERIAL_BELOW`` values, where a parallel launch costs more than the work. The CUDA
kernels (in ``_cuda``, imported on first use) run one thread per output byte to
pack and one thread per value to unpack, on PyTorch's current stream. Nothing here
imports Numba before a kernel is first asked for.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from memctl.codecs import _backend
from memctl.codecs._launch import DirectLaunch

__all__ = [
    "SERIAL_BELOW",
    "cpu_kernels",
    "cuda_kernels",
    "pack_cpu",
    "pack_cuda",
    "two_valued_cpu",
    "unpack_cpu",
    "unpack_cuda",
]

_TPB = 256
# Below this many values the serial compilation runs (a parallel launch costs more than the work).
SERIAL_BELOW = 1 << 18


@functools.cache
def cpu_kernels() -> ModuleType:
    """The module of CPU kernels, :mod:`memctl.codecs.lossless._cpu` (imports Numba).

    The first call in a process compiles them when Numba's cache does not hold them yet, and
    says so in the log (NOTE [ Kernel cache ] in :mod:`memctl.codecs._numba`).
    """
    from numba import types as nt

    from memctl.codecs import _numba
    from memctl.codecs.lossless import _cpu

    sig = [(nt.uint8[::1], nt.uint8[::1])]
    two = [(w[::1], nt.uint8[::1], w[::1]) for w in (nt.int16, nt.int32, nt.int64)]
    _numba.prepare(
        "lossless",
        [(_cpu.pack, sig), (_cpu.pack_serial, sig), (_cpu.unpack, sig), (_cpu.unpack_serial, sig),
         (_cpu.two_valued_serial, two)],
    )
    return _cpu


def pack_cpu(mask: torch.Tensor) -> torch.Tensor:
    """Pack a contiguous 1-D bool CPU tensor into ``ceil(n / 8)`` bytes."""
    n = mask.numel()
    out = torch.empty(-(-n // 8), dtype=torch.uint8)
    if n:
        k = cpu_kernels()
        args = (mask.view(torch.uint8).numpy(), out.numpy())
        if n < SERIAL_BELOW:
            k.pack_serial(*args)
        else:
            from memctl.codecs import _numba

            _numba.launch(k.pack, k.pack_serial, *args)
    return out


def two_valued_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(payload, values)`` of a contiguous 1-D integer CPU tensor (a float tensor's bit
    patterns) that takes at most two values: the bits of ``x != values[0]`` packed as
    :func:`pack_cpu` packs, and the two values; None when it takes more (NOTE [ Two-valued
    floats ] in the codec module). One serial pass, stopped at the first third value."""
    out = torch.empty(-(-x.numel() // 8), dtype=torch.uint8)
    values = torch.empty(2, dtype=x.dtype)
    if not cpu_kernels().two_valued_serial(x.numpy(), out.numpy(), values.numpy()):
        return None
    return out, values


def unpack_cpu(payload: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` bools a packed CPU payload holds, 1-D."""
    out = torch.empty(n, dtype=torch.uint8)
    if n:
        k = cpu_kernels()
        args = (payload.numpy(), out.numpy())
        if n < SERIAL_BELOW:
            k.unpack_serial(*args)
        else:
            from memctl.codecs import _numba

            _numba.launch(k.unpack, k.unpack_serial, *args)
    return out.view(torch.bool)


def cuda_kernels() -> Any:
    """The module of CUDA kernels (imports ``numba.cuda``; kernels compile on first launch)."""
    _backend.cuda()
    from memctl.codecs.lossless import _cuda as _lossless_cuda

    return _lossless_cuda


@functools.cache
def _direct(name: str) -> DirectLaunch:
    """The CUDA kernel ``name``, launched directly (NOTE [ Direct kernel launch ])."""
    return DirectLaunch(getattr(cuda_kernels(), name), f"lossless.{name}")


def pack_cuda(mask: torch.Tensor) -> torch.Tensor:
    """Pack a contiguous 1-D bool tensor with the CUDA kernel (CPU tensors in the simulator)."""
    dev = mask.device
    n = mask.numel()
    out = torch.empty(-(-n // 8), dtype=torch.uint8, device=dev)
    if n == 0:
        return out
    _direct("pack")(-(-out.numel() // _TPB), _TPB, dev, mask.view(torch.uint8), n, out)
    return out


def unpack_cuda(payload: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` bools of a packed payload, unpacked by the CUDA kernel."""
    dev = payload.device
    out = torch.empty(n, dtype=torch.uint8, device=dev)
    if n == 0:
        return out.view(torch.bool)
    _direct("unpack")(-(-n // _TPB), _TPB, dev, payload, n, out)
    return out.view(torch.bool)
