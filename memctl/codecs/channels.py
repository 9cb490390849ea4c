"""One-pass CPU kernels for the element-wise work around the codecs.

NOTE [ Fused channel passes ]
A batch-norm chain's records (NOTE [ Batch-norm outputs recomputed from the input ] in
``memctl/controller/normalized.py``) are read through per-channel affine maps: ``n = (z -
mean)·invstd`` when packed, ``z = n·std + mean`` and ``t = weight·n + bias`` when
unpacked, and a ReLU result then goes through its region projection (``max(t, floor)``
where its mask bit is 1, ``+0`` where it is 0). In PyTorch's CPU kernels each of those is
its own pass over the tensor with its own allocation: ``addcdiv`` with a per-channel
divisor took 3.7 ms on 2.4M values at one thread, ``mul_`` by a bool plane 2.2 ms (type
promotion), the comparison for a mask 2.5 ms plus the bit packing. :func:`affine` does one
pass, ``(x - sub[c])·scale[c] + shift[c]`` per value, and with a packed mask (the
``lossless`` codec's ``"bits"`` layout) also the projection; :func:`interval_bits` packs
the mask bits of an interval test straight from the values, with no bool tensor.

When the map's input is a quantised record (a chain's root, in normalised coordinates),
the decode writes the mapped tensor itself: :meth:`QuantizeCodec.decode_affine
<memctl.codecs.quantize.codec.QuantizeCodec.decode_affine>` maps a group's few levels
instead of its values when the group lies in one channel (every group of a feature map
of 256 values or more per channel), and maps value by value where a group spans two.
The values are those of :func:`affine` on the decoded tensor, bit for bit (the same
float32 operations in the same order; a value off the mask is ``y·0``, which is the +0.0
the decode's bit masking writes whenever ``y >= floor`` is finite, and the value-by-value
path otherwise). A record with a non-finite value (the codec puts those back after its
kernel) is decoded and mapped apart. On 2.4M values at 2 bits, one thread: decode 0.84
ms, then the map 0.41 ms (masked 1.17 ms), against 1.17 ms (masked 1.34 ms) for the two
in one pass. The project's CNN (``benchmarks/training.py``) reads ten such records a step.

Both return None where they do not apply (not a contiguous float32 CPU tensor, a
channel dimension that does not match, an interval with no finite bound), and the caller
runs its PyTorch ops: the results are the same values, rounded as ``x - sub``, then
``·scale``, then ``+ shift`` in float32 (no fused multiply-add). On a GPU the PyTorch ops
already run as one kernel each at memory bandwidth, and stay. The projection matches
:meth:`~memctl.controller.regions.Partition.project` for ReLU's result value for value,
NaN included (``max`` keeps a NaN, ``NaN·0`` is NaN).
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import numpy as np
import torch

__all__ = ["SERIAL_BELOW", "affine", "interval_bits"]

SERIAL_BELOW = 1 << 16
"""Below this many values the serial compilation runs (a parallel launch costs more than the work)."""


@functools.cache
def cpu_kernels() -> ModuleType:
    """The module of CPU kernels, :mod:`memctl.codecs._channels_cpu` (imports Numba)."""
    from numba import types as nt

    from memctl.codecs import _channels_cpu, _numba

    f32 = nt.float32[::1]
    aff = [(f32, f32, f32, f32, nt.int64, f32, nt.uint8[::1], nt.boolean, nt.float32, nt.int64)]
    bits = [(f32, nt.float32, nt.float32, nt.boolean, nt.boolean, nt.uint8[::1])]
    k = _channels_cpu
    _numba.prepare("channels", [(k.affine, aff), (k.affine_serial, aff),
                                (k.interval_bits, bits), (k.interval_bits_serial, bits)])
    return _channels_cpu


def _cpu32(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.layout == torch.strided


def _vector(v: torch.Tensor, channels: int) -> torch.Tensor | None:
    if v.device.type != "cpu" or v.dtype != torch.float32 or v.numel() != channels:
        return None
    return v.reshape(-1).contiguous()


_EMPTY = torch.zeros(1, dtype=torch.uint8)


def affine(
    x: torch.Tensor, sub: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
    mask: torch.Tensor | None = None, floor: float = 0.0,
) -> torch.Tensor | None:
    """``(x - sub[c])·scale[c] + shift[c]`` for channel ``c = `` dimension 1 of ``x``; with ``mask``
    (``ceil(numel / 8)`` uint8, bit ``i % 8`` of byte ``i // 8``), ``max(·, floor)`` where the bit is
    1 and ``·0`` where it is 0 (NOTE [ Fused channel passes ]). None where the kernel does not apply."""
    if not _cpu32(x) or not x.is_contiguous() or x.dim() < 2 or x.numel() == 0:
        return None
    channels = int(x.shape[1])
    vectors = [_vector(v, channels) for v in (sub, scale, shift)]
    if any(v is None for v in vectors):
        return None
    n = x.numel()
    if mask is not None and (mask.device.type != "cpu" or mask.dtype != torch.uint8
                             or mask.numel() != -(-n // 8) or not mask.is_contiguous()):
        return None
    inner = n // (int(x.shape[0]) * channels)
    out = torch.empty_like(x)
    k = cpu_kernels()
    a, s, h = (v.numpy() for v in vectors if v is not None)
    bits = _EMPTY if mask is None else mask
    args = (x.detach().reshape(-1).numpy(), a, s, h, inner, out.view(-1).numpy(), bits.numpy(),
            mask is not None, np.float32(floor))
    blocks = n // inner
    if n < SERIAL_BELOW:
        k.affine_serial(*args, blocks)
    else:
        from memctl.codecs import _numba

        per = max(1, blocks // (16 * _numba.threads()))
        _numba.launch(k.affine, k.affine_serial, *args, per)
    return out


def interval_bits(x: torch.Tensor, lo: float, hi: float, lo_open: bool, hi_open: bool) -> torch.Tensor | None:
    """The packed mask (``ceil(numel / 8)`` uint8, the ``lossless`` codec's ``"bits"`` layout, values in
    ``x``'s logical order) of ``lo (<|<=) x (<|<=) hi``; None where the kernel does not apply or the
    interval has no finite bound (NOTE [ Fused channel passes ])."""
    if not _cpu32(x) or (math.isinf(lo) and math.isinf(hi)):
        return None
    flat = x.detach().reshape(-1)
    if not flat.is_contiguous():
        return None
    n = flat.numel()
    out = torch.empty(-(-n // 8), dtype=torch.uint8)
    if n:
        k = cpu_kernels()
        args = (flat.numpy(), np.float32(lo), np.float32(hi), bool(lo_open), bool(hi_open), out.numpy())
        if n < SERIAL_BELOW:
            k.interval_bits_serial(*args)
        else:
            from memctl.codecs import _numba

            _numba.launch(k.interval_bits, k.interval_bits_serial, *args)
    return out
