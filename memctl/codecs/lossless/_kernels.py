"""Numba kernels of the ``lossless`` codec: packing bool masks at one bit per value.

Byte ``k`` of the payload holds values ``8k .. 8k+7``, value ``8k + j`` in bit ``j``
(LSB first); the bits past the last value are 0. The CPU kernel is a ``prange`` over
output bytes (compiled a second time without ``parallel`` for masks below
``SERIAL_BELOW`` values, where a parallel launch costs more than the work). The CUDA
kernels (in ``_cuda``, imported on first use) run one thread per output byte to
pack and one thread per value to unpack, on PyTorch's current stream. Nothing here
imports Numba before a kernel is first asked for.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from memctl.codecs import _backend

__all__ = [
    "SERIAL_BELOW",
    "cpu_kernels",
    "cuda_kernels",
    "pack_cpu",
    "pack_cuda",
    "unpack_cpu",
    "unpack_cuda",
]

_TPB = 256
# Below this many values the serial compilation runs (a parallel launch costs more than the work).
SERIAL_BELOW = 1 << 18


@functools.cache
def cpu_kernels() -> SimpleNamespace:
    """The CPU pack/unpack kernels (compiled by Numba on their first call)."""
    import numba
    from numba import prange

    def pack(bits: Any, out: Any) -> None:
        n = bits.size
        full = n // 8
        for k in prange(full):
            j = 8 * k
            out[k] = (
                bits[j]
                | (bits[j + 1] << 1)
                | (bits[j + 2] << 2)
                | (bits[j + 3] << 3)
                | (bits[j + 4] << 4)
                | (bits[j + 5] << 5)
                | (bits[j + 6] << 6)
                | (bits[j + 7] << 7)
            )
        if full < out.size:
            acc = 0
            for i in range(8 * full, n):
                acc |= bits[i] << (i - 8 * full)
            out[full] = acc

    def unpack(payload: Any, out: Any) -> None:
        n = out.size
        for k in prange((n + 7) // 8):
            b = payload[k]
            for j in range(min(8, n - 8 * k)):
                out[8 * k + j] = (b >> j) & 1

    parallel = numba.njit(parallel=True, cache=False, nogil=True)
    serial = numba.njit(parallel=False, cache=False, nogil=True)  # prange runs as range
    return SimpleNamespace(
        pack=parallel(pack), unpack=parallel(unpack), pack_serial=serial(pack), unpack_serial=serial(unpack)
    )


def pack_cpu(mask: torch.Tensor) -> torch.Tensor:
    """Pack a contiguous 1-D bool CPU tensor into ``ceil(n / 8)`` bytes."""
    n = mask.numel()
    out = torch.empty(-(-n // 8), dtype=torch.uint8)
    if n:
        k = cpu_kernels()
        (k.pack_serial if n < SERIAL_BELOW else k.pack)(mask.view(torch.uint8).numpy(), out.numpy())
    return out


def unpack_cpu(payload: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` bools a packed CPU payload holds, 1-D."""
    out = torch.empty(n, dtype=torch.uint8)
    if n:
        k = cpu_kernels()
        (k.unpack_serial if n < SERIAL_BELOW else k.unpack)(payload.numpy(), out.numpy())
    return out.view(torch.bool)


def cuda_kernels() -> Any:
    """The module of CUDA kernels (imports ``numba.cuda``; kernels compile on first launch)."""
    _backend.cuda()
    from memctl.codecs.lossless import _cuda as _lossless_cuda

    return _lossless_cuda


def pack_cuda(mask: torch.Tensor) -> torch.Tensor:
    """Pack a contiguous 1-D bool tensor with the CUDA kernel (CPU tensors in the simulator)."""
    dev = mask.device
    n = mask.numel()
    out = torch.empty(-(-n // 8), dtype=torch.uint8, device=dev)
    if n == 0:
        return out
    d_out = _backend.to_device_array(out)
    blocks = -(-out.numel() // _TPB)
    cuda_kernels().pack[blocks, _TPB, _backend.torch_stream(dev)](
        _backend.to_device_array(mask.view(torch.uint8)), n, d_out
    )
    return _backend.from_device_array(d_out, dev)


def unpack_cuda(payload: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` bools of a packed payload, unpacked by the CUDA kernel."""
    dev = payload.device
    out = torch.empty(n, dtype=torch.uint8, device=dev)
    if n == 0:
        return out.view(torch.bool)
    d_out = _backend.to_device_array(out)
    cuda_kernels().unpack[-(-n // _TPB), _TPB, _backend.torch_stream(dev)](
        _backend.to_device_array(payload), n, d_out
    )
    return _backend.from_device_array(d_out, dev).view(torch.bool)
