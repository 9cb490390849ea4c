"""The ``lossless`` codec: exact storage of any tensor, bool masks at one bit per value.

Format: one uint8 buffer ``payload``.

- ``torch.bool``: ``ceil(n / 8)`` bytes, value ``j`` of the flattened tensor in bit ``j % 8``
  of byte ``j // 8`` (LSB first), the bits past the end 0: 8x smaller than PyTorch's
  one byte per bool (dropout and ReLU masks are saved as bools).
- ``int16``/``int32``/``int64``: when the values span a narrower range, the values minus
  their minimum in the narrowest of 8, 16 or 32 bits (buffer ``payload``) and the minimum
  as one int64 (buffer ``offset``); NOTE [ Integer narrowing ].
- ``int32``/``int64`` pooling indices (at least 3 dimensions) that lie inside their pooling
  window: each value's position in its window, bit-packed (2 bits for a 2x2 window), and
  the geometry in ``params``; NOTE [ Window codes ] in ``_window.py``.
- floats (float16, bfloat16, float32, float64) on a CPU that take at most two distinct
  values (bit patterns): one bit a value (buffer ``payload``, set where a value differs
  from the first) and the two values (buffer ``values``); NOTE [ Two-valued floats ].
- every other tensor (other floats, uint8, int8, complex): the raw bytes of a contiguous copy.

The record is always a copy: modifying the tensor after ``encode`` (autograd no longer
detects in-place changes of a saved tensor once hooks are active) leaves the record as it
was, and ``decode`` returns a fresh tensor, never a view of the record.

The three codecs' formats side by side: docs/formats.md, "lossless".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memctl.codecs import _backend, _rng
from memctl.codecs.base import Impl, Packed
from memctl.codecs.lossless import _reference, _window
from memctl.errors import CodecError

__all__ = ["LosslessCodec", "LosslessConfig", "bits_record"]

# NOTE [ Integer narrowing ]
# Max-pool saves int64 indices into each input plane (0..H·W-1): at 8 bytes a value they
# can outweigh the 2-bit activations around them. An integer tensor whose span
# max − min fits a narrower unsigned width is stored as (x − min − 2^(w−1)) in the signed
# type of w bits, with min kept in an int64 buffer, so decoding is exact. Finding the span
# is one reduction. The narrowing is PyTorch code shared by every implementation, so their
# records stay byte-identical. A CUDA tensor is not narrowed: choosing the width reads the
# span back, which waits for every op queued on the GPU before it (the cross-entropy target,
# saved last in a forward, waited for the whole forward); token ids and targets, one value a
# position, weigh little beside the activations, and pooling indices take window codes.
_NARROW: dict[torch.dtype, tuple[tuple[int, torch.dtype], ...]] = {
    torch.int16: ((8, torch.int8),),
    torch.int32: ((8, torch.int8), (16, torch.int16)),
    torch.int64: ((8, torch.int8), (16, torch.int16), (32, torch.int32)),
}
_MIN_NARROW_NUMEL = 64

# NOTE [ Two-valued floats ]
# On a CPU, ``F.dropout`` multiplies by a float mask of zeros and ``1/(1-p)``, which the
# product's node saves: a full-size float tensor with two values (on a GPU, dropout saves a
# bool mask instead). Stored raw it is 32 bits a value; quantised, 2 bits and the groups'
# ranges at the least. A float tensor whose bit patterns take at most two values is stored
# as one bit a value and the two patterns, and decoded by selecting between them on the
# integer view, so every value, a signed zero, an infinity and a NaN's payload included,
# comes back bit for bit. Finding out is one pass over the integer view that stops at the
# first third value (a tensor of many values costs a few reads); the CPU kernel and the
# PyTorch reference write the same bytes. A CUDA tensor is not tried (the answer would be
# read back, a wait, as for NOTE [ Integer narrowing ]).
_TWO_VALUED: dict[torch.dtype, torch.dtype] = {
    torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
    torch.float64: torch.int64,
}

_NAME = "lossless"


@dataclass(frozen=True)
class LosslessConfig:
    """Configuration of :class:`LosslessCodec`: it has no options (kept for a uniform API)."""


class LosslessCodec:
    """Exact codec for any dtype; see the module docstring for the format.

    Promises: ``decode(encode(t))`` equals ``t`` bit for bit, with its shape, dtype and device.
    """

    name = _NAME

    def __init__(self) -> None:
        self.config = LosslessConfig()
        self._cuda = _backend.CudaFallback(_NAME)

    def __repr__(self) -> str:
        return "LosslessCodec()"

    def encode(
        self,
        t: torch.Tensor,
        *,
        bits: int | None = None,
        error_bound: float | None = None,
        seed: int = 0,
        impl: Impl | str | None = None,
    ) -> Packed:
        """Store ``t`` exactly (``bits`` and ``error_bound`` must be None; ``seed`` is unused)."""
        _backend.require_tensor(t, _NAME)
        if bits is not None or error_bound is not None:
            raise CodecError(
                f"'lossless' is exact and takes no bits/error_bound (got bits={bits!r}, "
                f"error_bound={error_bound!r}); pass neither, or use 'quantize'/'errorbound'"
            )
        _rng.check_seed(seed)
        chosen = _backend.resolve_impl(impl, t.device)
        flat = t.detach().reshape(-1)
        buffers: dict[str, torch.Tensor] = {}
        if t.dtype is torch.bool:
            return bits_record(self._pack(chosen, flat.contiguous()), tuple(t.shape), t.device)
        if (found := _window.window_codes(t.detach())) is not None:
            window, planes = found
            buffers["payload"] = torch.cat([self._pack(chosen, plane.contiguous()) for plane in planes])
            return Packed(codec=_NAME, shape=tuple(t.shape), dtype=t.dtype, device=t.device, buffers=buffers,
                          params={"layout": "window", "bits": window.bits, **window.to_params()})
        two = self._two_valued(chosen, flat, tuple(t.shape))
        if two is not None:
            return two
        narrowed = _narrow(flat)
        if narrowed is not None:
            buffers["payload"], buffers["offset"], width = narrowed
            layout = f"narrow{width}"
        else:
            buffers["payload"] = flat.clone(memory_format=torch.contiguous_format).view(torch.uint8)
            layout = "raw"
        return Packed(
            codec=_NAME,
            shape=tuple(t.shape),
            dtype=t.dtype,
            device=t.device,
            buffers=buffers,
            params={"layout": layout},
        )

    def two_valued(self, t: torch.Tensor, *, impl: Impl | str | None = None) -> Packed | None:
        """``encode(t)`` when ``t`` is a CPU float tensor of at most two distinct values (NOTE [
        Two-valued floats ]), else None (a test that reads a few values of most tensors)."""
        _backend.require_tensor(t, _NAME)
        return self._two_valued(_backend.resolve_impl(impl, t.device), t.detach().reshape(-1), tuple(t.shape))

    def _two_valued(self, chosen: Impl, flat: torch.Tensor, shape: tuple[int, ...]) -> Packed | None:
        """The two-valued record of ``flat`` (a tensor of ``shape``, flattened), or None."""
        view = _TWO_VALUED.get(flat.dtype)
        if view is None or flat.numel() < _MIN_NARROW_NUMEL or not flat.is_cpu:
            return None
        x = flat.contiguous().view(view)
        if chosen is Impl.CPU:
            from memctl.codecs.lossless import _kernels as _lossless_kernels

            found = _lossless_kernels.two_valued_cpu(x)
        else:
            found = _reference.two_valued(x)
        if found is None:
            return None
        payload, values = found
        return Packed(codec=_NAME, shape=shape, dtype=flat.dtype, device=flat.device,
                      buffers={"payload": payload, "values": values}, params={"layout": "two"})

    def decode(self, p: Packed, *, impl: Impl | str | None = None) -> torch.Tensor:
        """The exact tensor a record holds, as a new tensor on the record's device."""
        if not isinstance(p, Packed) or p.codec != _NAME:
            got = p.codec if isinstance(p, Packed) else type(p).__name__
            raise CodecError(f"'lossless' decodes its own Packed records, got {got!r}; use codecs.decode(p)")
        if "payload" not in p.buffers:
            raise CodecError("lossless record lacks its 'payload' buffer; it was not written by encode")
        payload = p.buffers["payload"]
        chosen = _backend.resolve_impl(impl, p.device)
        if p.dtype is torch.bool:
            flat = self._unpack(chosen, payload, p.numel)
        elif p.params.get("layout") == "window":
            window = _window.Window.from_params(p.params)
            size = -(-p.numel // 8)
            planes = [self._unpack(chosen, payload[b * size:(b + 1) * size], p.numel)
                      for b in range(window.bits)]
            flat = _window.indices(planes, window, p.shape, p.dtype)
        elif p.params.get("layout") == "two":
            values = p.buffers["values"]
            differs = self._unpack(chosen, payload, p.numel)
            flat = torch.where(differs, values[1], values[0]).view(p.dtype)
        elif str(p.params.get("layout", "")).startswith("narrow"):
            flat = _widen(payload, p.buffers["offset"], p.dtype, int(str(p.params["layout"])[6:]))
        else:
            flat = payload.clone().view(p.dtype)
        return flat.reshape(p.shape).to(p.device)

    def _pack(self, chosen: Impl, mask: torch.Tensor) -> torch.Tensor:
        from memctl.codecs.lossless import _kernels as _lossless_kernels

        if chosen is Impl.CPU:
            return _lossless_kernels.pack_cpu(mask)
        if chosen is Impl.CUDA:
            return self._cuda.run(lambda: _lossless_kernels.pack_cuda(mask), lambda: _reference.pack(mask))
        return _reference.pack(mask)

    def _unpack(self, chosen: Impl, payload: torch.Tensor, n: int) -> torch.Tensor:
        from memctl.codecs.lossless import _kernels as _lossless_kernels

        if chosen is Impl.CPU:
            return _lossless_kernels.unpack_cpu(payload, n)
        if chosen is Impl.CUDA:
            return self._cuda.run(lambda: _lossless_kernels.unpack_cuda(payload, n),
                                  lambda: _reference.unpack(payload, n))
        return _reference.unpack(payload, n)


def bits_record(payload: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> Packed:
    """The record of a bool tensor of ``shape`` whose bits ``payload`` holds (the ``"bits"`` layout):
    what :meth:`LosslessCodec.encode` returns for it, for kernels that pack the bits themselves."""
    return Packed(codec=_NAME, shape=shape, dtype=torch.bool, device=device,
                  buffers={"payload": payload}, params={"layout": "bits"})


def _narrow(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``(payload, offset, bits)`` of NOTE [ Integer narrowing ], or None when nothing is saved."""
    widths = _NARROW.get(flat.dtype)
    if widths is None or flat.numel() < _MIN_NARROW_NUMEL or flat.is_cuda:
        return None
    lo, hi = torch.aminmax(flat)
    span = int(hi.to(torch.int64)) - int(lo.to(torch.int64))
    for bits, narrow in widths:
        if span < (1 << bits):
            shifted = flat.to(torch.int64) - (lo.to(torch.int64) + (1 << (bits - 1)))
            payload = shifted.to(narrow).contiguous().view(torch.uint8)
            return payload, lo.to(torch.int64).reshape(1).clone(), bits
    return None


def _widen(payload: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype, bits: int) -> torch.Tensor:
    """Inverse of :func:`_narrow` for a payload of ``bits``-bit values."""
    narrow = {8: torch.int8, 16: torch.int16, 32: torch.int32}[bits]
    values = payload.view(narrow).to(torch.int64) + (offset.to(torch.int64) + (1 << (bits - 1)))
    return values.to(dtype)
