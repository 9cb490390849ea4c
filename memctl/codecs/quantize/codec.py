"""The ``quantize`` codec: ActNN-style per-group stochastic quantization to 1, 2, 4 or 8 bits.

Format (one record per tensor; ``n`` values of the flattened tensor, ``G`` the group size,
``b`` the bits, ``B = 2**b - 1``, ``ngroups = ceil(n / G)``):

- ``meta``: float32 ``[ngroups, 2]``, each group's ``(min, max)`` over its finite values,
  exact (an all-non-finite group stores ``(0, 0)``; a zero is stored as ``+0.0``).
- ``payload``: uint8 ``[ngroups * G * b / 8]``, value ``j``'s code at byte ``(j*b) // 8``,
  bit offset ``(j*b) % 8`` (little-endian within a byte); the last group's padding codes are 0.
- ``exc_index`` (int64) and ``exc_value`` (float32): positions and original values of the
  NaN/±Inf inputs, which are coded 0 and written back by decode (see NOTE [ Exception list ]).
  A float64 tensor is quantised through its float32 values (NOTE [ Float64 through float32 ]):
  its exceptions are also the values outside float32's range, kept in float64.

Encode, per finite value ``x`` of a group with ``mn, mx = meta[g]`` (all float64, IEEE)::

    R = mx - mn;   s = (B * 2**24) / R  (s = 0 if R == 0)
    T = int64((x - mn) * s)             # truncation, T >= 0: the position in 2**-24 steps
    r = hash(seed, index) >> 8          # 24 random bits, NOTE [ Counter-based RNG ]
    q = min((T + r) >> 24, B)

which is ``T = trunc(t * 2**24)`` with ``t = (x - mn) * B / R``: folding the exact power-of-two
factor into ``s`` changes no bit (no overflow or underflow is possible in float64). ``q`` is
``floor(t)`` or ``floor(t) + 1``, the latter with probability ``frac(t)`` up to ``2**-24``:
unbiased stochastic rounding, done in integers. Decode::

    x_hat = float32(mn + (q * R) / B), clamped to [mn, mx], then cast to the original dtype.

NOTE [ Quantize arithmetic ]
No step of encode or decode multiplies and then adds (``(x - mn) * s`` subtracts first; decode
adds after a division). libNVVM contracts multiply-add pairs into FMAs unless given ``-fma=0``,
and Numba-CUDA passes no such option with ``fastmath=False``; with no such pair there is
nothing to contract, and the reference, the CPU kernel and the CUDA kernel write identical
bytes. Divisions are IEEE in all three (the reference never divides by a
Python scalar, which PyTorch's CUDA backend turns into a reciprocal multiply).

NOTE [ float32 group metadata ]
``min`` and ``max`` are stored as float32, not float16: they are then exact for any float32
input, including values near 1e38, tiny and denormal ones, so the one-step error bound holds
everywhere. The cost is 8 bytes per group: at 2 bits and G = 256 a float32 group takes
1024 bytes raw and 64 + 8 packed, a ratio of 14.2x (float16 metadata would give 15.1x).

NOTE [ Exception list ]
Non-finite inputs are rare in activations but must survive (a NaN that decodes finite
hides a divergence). They are excluded from min/max, coded 0, and listed with torch ops
(``isfinite``, ``nonzero``) in every implementation, so the lists are identical. The kernels
report whether any group held one, so the lists are only built when needed; on a GPU that
report is read once it has arrived, without waiting for it (NOTE [ Exception lists without
a wait ] in ``_pending.py``).

NOTE [ Eight-bit groups ]
At 8 bits a record's groups are a quarter of the configured ``group_size`` when it is a
multiple of 32 (64 values for 256; :func:`group_at`), so that an 8-bit group holds as many
payload bytes as a 2-bit group does. A value's rounding error is a fraction of its group's
range, and the range of 256 values is set by their largest outliers: in a transformer's
projections and attention the one outlier of a group widens the step of the 255 values
beside it. With 8-bit groups of 256, whole-gradient cosines at 8 bits of 0.99983-0.99989
were measured (one step, every layer at 8 bits: T5, LeViT, Mamba, Qwen3, OLMo-2; the issue's
target is 0.9999); in groups of 64, 0.99989-0.99994. The record costs 9 bits a value
instead of 8.25 (meta 8 bytes a group); the widths 1, 2 and 4 keep ``group_size``, whose
variance the allocation's model was fitted to. Stochastic rounding stays (unbiased); the
record's ``group_size`` parameter is the group it was written in, which decode reads.

The three codecs' formats side by side: docs/formats.md, "quantize".

NOTE [ Positive mask in encode ]
A ReLU output keeps the bit mask of its positive values next to its record (NOTE [ ReLU
masks ] in ``memctl/controller/packing.py``): ``lossless.encode(t > 0)``, a comparison
pass and a packing pass over the whole tensor. ``encode_with_positive`` writes the same
lossless record, byte for byte, from inside the CPU encode kernel, per group while the
group's values sit in L1 after the min/max pass, so the tensor is read once; the CUDA team
kernels write it from the values each lane holds in registers (NOTE [ Quantize CUDA kernels ]
in ``_kernels``). The reference computes ``t > 0`` and calls the lossless codec, and so do
the CUDA paths without a one-pass kernel (groups larger than a warp's tile, and the
reference that runs after a CUDA compile failure): the bytes are the same.

NOTE [ Masked decode ]
``decode(p, mask=m)`` takes the bit mask of the values that must come back positive (a
ReLU output's ``t > 0``, packed as the lossless codec packs bools) and returns, byte for
byte, ``decode(p).clamp_min_(floor).mul_(m)`` with ``floor`` = ``mask_floor(dtype)``
(``2**-64``, or the dtype's smallest normal number where larger: NOTE [ Mask floor ] in
``memctl/codecs/base.py``): values off the mask are +0.0, values on it at least ``floor``.
The kernels (and the reference) apply it per group right after expanding the codes, while
the group is in L1, so the output is written once instead of being decoded, then clamped,
then multiplied. Raising to ``floor`` in float32 before the cast to float16/bfloat16 gives
the same bits as after it, because ``floor`` is exact in both and rounding is monotonic. Non-finite values
(the exception list) are written back after the kernel and masked the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memctl.codecs import _backend, _rng
from memctl.codecs.base import FLOAT_DTYPES, Impl, Packed, mask_floor
from memctl.codecs.lossless.codec import bits_record
from memctl.codecs.quantize import _kernels as _quantize_kernels
from memctl.codecs.quantize import _pending, _reference
from memctl.errors import CodecError, ConfigError

__all__ = ["BITS", "MAX_GROUP_SIZE", "QuantizeCodec", "QuantizeConfig", "group_at", "packed_nbytes"]

BITS: tuple[int, ...] = (1, 2, 4, 8)
#: The largest group size (values per (min, max) pair): 2**24.
MAX_GROUP_SIZE = 1 << 24
_NAME = "quantize"
_BUFFERS = frozenset({"payload", "meta", "exc_index", "exc_value"})


def _check_group_size(group_size: object) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) \
            or not 0 < group_size <= MAX_GROUP_SIZE or group_size % 8:
        shown = f"an int of {group_size.bit_length()} bits" if isinstance(group_size, int) \
            and abs(group_size) > 2**64 else repr(group_size)
        raise ConfigError(
            f"group_size={shown} must be a positive multiple of 8 up to {MAX_GROUP_SIZE} (e.g. 128, 256); "
            "round it to a multiple of 8"
        )
    return group_size


def _check_bits(bits: object) -> int:
    if isinstance(bits, bool) or bits not in BITS:
        raise CodecError(f"bits={bits!r} is not supported by 'quantize'; use one of {list(BITS)}")
    return int(bits)


@dataclass(frozen=True)
class QuantizeConfig:
    """Configuration of :class:`QuantizeCodec`.

    Attributes:
        group_size: values per group sharing one (min, max); a positive multiple of 8.
        bits: default bits per value when ``encode`` gets ``bits=None``; one of 1, 2, 4, 8.
    """

    group_size: int = 256
    bits: int = 2

    def __post_init__(self) -> None:
        _check_group_size(self.group_size)
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise ConfigError(f"bits={self.bits!r} must be one of {list(BITS)}; e.g. bits=2")


def group_at(bits: int, group_size: int) -> int:
    """The values per group of a record at ``bits`` from a codec configured with ``group_size``:
    a quarter of it at 8 bits when ``group_size`` is a multiple of 32, else ``group_size``
    (NOTE [ Eight-bit groups ])."""
    return group_size // 4 if bits == 8 and group_size % 32 == 0 else group_size


def packed_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Exact ``Packed.nbytes`` of a quantize record of ``numel`` values with no non-finite value,
    written by a codec configured with ``group_size``."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ConfigError(f"numel={numel!r} must be a non-negative int")
    b = _check_bits(bits)
    g = group_at(b, _check_group_size(group_size))
    ngroups = -(-numel // g)
    return ngroups * (g * b // 8) + ngroups * 2 * 4


ENCODES = (*FLOAT_DTYPES, torch.float64)
"""The dtypes ``encode`` takes.

NOTE [ Float64 through float32 ]
A float64 tensor (a scientific model trained in double precision) is quantised through its
float32 values: at 8 bits or fewer a value's quantisation step is far above float32's rounding,
so the kernels, the metadata and the payload stay those of float32, and decode casts back to
float64. A finite float64 value outside float32's range becomes ±Inf in float32, where it would
come back as an infinity: such values go to the exception list with the non-finite ones, in
float64, and come back exactly. Values below float32's smallest subnormal come back as zero,
within their group's step.
"""


def _check_input(t: torch.Tensor) -> None:
    """A tensor of a dtype ``encode`` takes, else a ``CodecError`` naming the fix."""
    _backend.require_tensor(t, _NAME)
    if t.dtype not in ENCODES:
        raise CodecError(
            f"'quantize' encodes {[str(d) for d in ENCODES]}, got {t.dtype}; "
            "convert with .float() or use the 'lossless' codec"
        )


def _flat_float32(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D float32 tensor of ``t``'s values (a view when ``t`` already is one)."""
    if t.dtype is torch.float32 and t.is_contiguous():
        return t.detach().view(-1)
    return t.detach().reshape(-1).to(torch.float32).contiguous()


def _exceptions(flat: torch.Tensor, source: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and values of the non-finite entries of a flat float32 tensor; the values are
    ``source``'s own when it is the float64 tensor ``flat`` was made from (NOTE [ Float64 through
    float32 ]: a finite value outside float32's range is one of them)."""
    index = torch.nonzero(~torch.isfinite(flat)).reshape(-1)
    if source is not None and source.dtype is torch.float64:
        return index, source.detach().reshape(-1)[index]
    return index, flat[index]


def _source_exceptions(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and values (as float32; a float64 tensor's in float64) of the non-finite entries of
    a tensor of any shape."""
    return _exceptions(_flat_float32(t), t)


class QuantizeCodec:
    """Per-group stochastic quantization (ActNN, Chen et al., ICML 2021); format in the module docstring.

    Promises: ``decode(encode(t))`` has ``t``'s shape, dtype and device; every finite value is
    within one step ``(max - min) / B`` of its group (plus the final rounding to ``t.dtype``);
    ``E[decode(encode(t, seed=S))] = t`` over random seeds; NaN/±Inf come back in place.
    """

    name = _NAME
    decodes_mask = True
    """``decode`` takes ``mask=`` (NOTE [ Masked decode ], NOTE [ Masks in decode ] in ``base.py``)."""

    def __init__(self, group_size: int = 256, bits: int = 2) -> None:
        self.config = QuantizeConfig(group_size=group_size, bits=bits)
        self._cuda = _backend.CudaFallback(_NAME)
        self._empty: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._groups = {b: group_at(b, self.config.group_size) for b in BITS}
        """The values per group of a record at each width (:func:`group_at`)."""

    def __repr__(self) -> str:
        return f"QuantizeCodec(group_size={self.config.group_size}, bits={self.config.bits})"

    def encode(
        self,
        t: torch.Tensor,
        *,
        bits: int | None = None,
        error_bound: float | None = None,
        seed: int = 0,
        impl: Impl | str | None = None,
    ) -> Packed:
        """Quantize ``t`` (float32/16, bfloat16, float64; any shape and layout) to ``bits`` per value."""
        _check_input(t)
        if error_bound is not None:
            raise CodecError(
                f"'quantize' takes bits, not error_bound={error_bound!r}; "
                "use codecs.get('errorbound') for an absolute error bound"
            )
        chosen, b, g, s = self._encode_args(t, bits, seed, impl)
        flat = _flat_float32(t)
        payload, meta, nonfinite = self._run_encode(chosen, flat, b, g, s)
        return Packed(
            codec=_NAME,
            shape=tuple(t.shape),
            dtype=t.dtype,
            device=t.device,
            buffers=self._buffers(t, flat, payload, meta, nonfinite),
            params={"bits": b, "group_size": g, "seed": s},
        )

    def _encode_args(self, t: torch.Tensor, bits: int | None, seed: int,
                     impl: Impl | str | None) -> tuple[Impl, int, int, int]:
        """``(implementation, bits, values per group, seed)`` of an encode of ``t``, validated.

        The common case (``bits`` one of :data:`BITS` or None, a seed in range, ``impl`` None)
        is checked here without a call per argument: this runs for every tensor the controller
        quantises (NOTE [ Pack path cost ] in ``memctl/controller/packing.py``); anything else
        goes through the checks that raise.
        """
        if bits is None:
            b = self.config.bits
        elif type(bits) is int and bits in self._groups:
            b = bits
        else:
            b = _check_bits(bits)
        s = seed if type(seed) is int and 0 <= seed < _rng.SEED_LIMIT else _rng.check_seed(seed)
        if impl is None:
            chosen = Impl.CUDA if t.device.type == "cuda" else Impl.CPU
        else:
            chosen = _backend.resolve_impl(impl, t.device)
        return chosen, b, self._groups[b], s

    def _buffers(self, t: torch.Tensor, flat: torch.Tensor, payload: torch.Tensor, meta: torch.Tensor,
                 nonfinite: int | torch.Tensor) -> Mapping[str, torch.Tensor]:
        """A record's buffers: the exception list built now (``nonfinite`` an int, non-zero when
        there are exceptions), or once the GPU's flag arrives (``nonfinite`` the flag on the
        device: NOTE [ Exception lists without a wait ] in ``_pending``)."""
        if isinstance(nonfinite, torch.Tensor):
            empty_index, empty_value = self._no_exceptions(payload.device)
            buffers = {"payload": payload, "meta": meta, "exc_index": empty_index, "exc_value": empty_value}
            return _pending.pend(buffers, _source_exceptions, t, nonfinite)
        if nonfinite:
            exc_index, exc_value = _exceptions(flat, t)
        else:
            exc_index, exc_value = self._empty.get(payload.device) or self._no_exceptions(payload.device)
        return {"payload": payload, "meta": meta, "exc_index": exc_index, "exc_value": exc_value}

    def encode_with_positive(
        self, t: torch.Tensor, *, bits: int | None = None, seed: int = 0, impl: Impl | str | None = None
    ) -> tuple[Packed, Packed]:
        """``(encode(t, ...), lossless.encode(t > 0))`` byte for byte, in one pass over ``t`` by the
        CPU and CUDA kernels (NOTE [ Positive mask in encode ])."""
        _backend.require_tensor(t, _NAME)
        if impl is not None:
            impl = _backend.resolve_impl(impl, t.device)
        if impl is Impl.REFERENCE or t.dtype not in ENCODES:
            from memctl.codecs.lossless.codec import LosslessCodec

            record = self.encode(t, bits=bits, seed=seed, impl=impl)
            return record, LosslessCodec().encode(t > 0, impl=impl)
        chosen, b, g, s = self._encode_args(t, bits, seed, impl)
        flat = _flat_float32(t)
        positive = torch.empty(-(-flat.numel() // 8), dtype=torch.uint8, device=flat.device)
        nonfinite: int | torch.Tensor
        if chosen is Impl.CPU:
            payload, meta, nonfinite = _quantize_kernels.encode_cpu(flat, b, g, s, positive)
        else:
            payload, meta, nonfinite = self._encode_cuda_with_positive(flat, b, g, s, positive)
        shape = tuple(t.shape)
        record = Packed(
            codec=_NAME,
            shape=shape,
            dtype=t.dtype,
            device=t.device,
            buffers=self._buffers(t, flat, payload, meta, nonfinite),
            params={"bits": b, "group_size": g, "seed": s},
        )
        return record, bits_record(positive, shape, t.device)

    def encode_into(
        self, t: torch.Tensor, payload: torch.Tensor, meta: torch.Tensor, *, bits: int, seed: int = 0,
        impl: Impl | str | None = None,
    ) -> bool:
        """Write ``encode(t, bits=bits, seed=seed)``'s payload and meta into the given buffers
        (contiguous, on ``t``'s device, of exactly the sizes ``encode`` would allocate); True
        when ``t`` holds a non-finite value, whose exception list the caller then builds.

        Lets a caller give several records views of one buffer that a single call fills
        (NOTE [ Batched small records ] in ``memctl/controller/batches.py``). The CPU kernel
        writes in place; the other implementations encode and copy.
        """
        _check_input(t)
        b = _check_bits(bits)
        s = _rng.check_seed(seed)
        g = group_at(b, self.config.group_size)
        ngroups = -(-t.numel() // g)
        if (payload.dtype is not torch.uint8 or payload.numel() != ngroups * g * b // 8
                or meta.dtype is not torch.float32 or tuple(meta.shape) != (ngroups, 2)
                or not payload.is_contiguous() or not meta.is_contiguous()
                or payload.device != t.device or meta.device != t.device):
            raise CodecError(
                f"encode_into needs a uint8 payload of {ngroups * g * b // 8} bytes and a float32 meta of "
                f"shape ({ngroups}, 2), contiguous on {t.device}; got {payload.dtype} {tuple(payload.shape)} "
                f"and {meta.dtype} {tuple(meta.shape)}"
            )
        chosen = _backend.resolve_impl(impl, t.device)
        flat = _flat_float32(t)
        if chosen is Impl.CPU:
            return _quantize_kernels.encode_cpu(flat, b, g, s, out=(payload, meta))[2] > 0
        record = self.encode(flat, bits=b, seed=s, impl=chosen)
        payload.copy_(record.buffers["payload"])
        meta.copy_(record.buffers["meta"])
        return record.buffers["exc_index"].numel() > 0

    def exceptions(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exception buffers ``encode(t)`` writes (positions and values of the non-finite
        entries; shared empty ones when there are none), for :meth:`encode_into`'s callers."""
        flat = _flat_float32(t)
        index, value = _exceptions(flat, t)
        if not index.numel():
            return self._no_exceptions(flat.device)
        return index, value

    def _encode_cuda_with_positive(
        self, flat: torch.Tensor, bits: int, group: int, seed: int, positive: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor]:
        """The CUDA encode that also fills ``positive`` (NOTE [ Positive mask in encode ]); after a
        compile failure, the reference and the lossless reference's packing (NOTE [ CUDA fallback ])."""

        def reference() -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor]:
            from memctl.codecs.lossless import _reference as _lossless_reference

            payload, meta = _reference.encode(flat, bits, group, seed)
            positive.copy_(_lossless_reference.pack(flat > 0))
            return payload, meta, 0 if bool(torch.isfinite(flat).all()) else 1

        return self._cuda.run(
            lambda: _quantize_kernels.encode_cuda(flat, bits, group, seed, positive), reference
        )

    def _no_exceptions(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty exception buffers for ``device``, made once: every record without a non-finite
        value shares them (a zero-size tensor holds nothing to modify)."""
        empty = self._empty.get(device)
        if empty is None:
            empty = self._empty[device] = (
                torch.empty(0, dtype=torch.int64, device=device),
                torch.empty(0, dtype=torch.float32, device=device),
            )
        return empty

    def _run_encode(
        self, chosen: Impl, flat: torch.Tensor, bits: int, group: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor]:
        if chosen is Impl.CPU:
            return _quantize_kernels.encode_cpu(flat, bits, group, seed)

        def reference() -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor]:
            payload, meta = _reference.encode(flat, bits, group, seed)
            return payload, meta, 0 if bool(torch.isfinite(flat).all()) else 1

        if chosen is Impl.CUDA:
            return self._cuda.run(lambda: _quantize_kernels.encode_cuda(flat, bits, group, seed), reference)
        return reference()

    def decode(
        self, p: Packed, *, impl: Impl | str | None = None, mask: Packed | torch.Tensor | None = None
    ) -> torch.Tensor:
        """The tensor a record holds: original shape, dtype and device.

        ``mask`` (NOTE [ Masked decode ]): the values that must come back positive, as a
        lossless record of a bool tensor (what ``codecs.get('lossless').encode(t > 0)``
        writes) or a bool tensor, with as many values as ``p``. The result is then, byte
        for byte, ``decode(p).clamp_min_(mask_floor(p.dtype)).mul_(mask)`` (NOTE [ Mask floor ]),
        written in one pass by the decode kernel.
        """
        bits, group = _record_params(p)
        payload, meta = p.buffers["payload"], p.buffers["meta"]
        n = p.numel
        if impl is None:  # (resolve_impl's choice, without its call: every decode)
            chosen = Impl.CUDA if p.device.type == "cuda" else Impl.CPU
        else:
            chosen = _backend.resolve_impl(impl, p.device)
        packed_mask = None if mask is None else _mask_bits(mask, p)
        floor = mask_floor(p.dtype)
        if chosen is Impl.CPU:
            flat = _quantize_kernels.decode_cpu(payload, meta, bits, group, n, packed_mask, floor)
        else:
            flat = self._run_decode(chosen, payload, meta, bits, group, n, packed_mask, floor)
        out = flat if flat.dtype is p.dtype else flat.to(p.dtype)
        exc_index = p.buffers["exc_index"]
        if exc_index.numel():
            index = exc_index.to(out.device)
            values = p.buffers["exc_value"].to(device=out.device, dtype=p.dtype)
            if packed_mask is not None:
                keep = (packed_mask.to(out.device)[index >> 3].to(torch.int64) >> (index & 7)) & 1
                values = values.clamp_min(floor).mul(keep.to(p.dtype))
            out[index] = values
        out = out.reshape(p.shape)
        return out if out.device == p.device else out.to(p.device)

    def decode_affine(
        self, p: Packed, sub: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, *,
        mask_bits: torch.Tensor | None = None, floor: float | None = None,
    ) -> torch.Tensor | None:
        """``channels.affine(decode(p), sub, scale, shift, mask=mask_bits, floor=floor)`` written in
        one pass by the CPU kernel (NOTE [ Fused channel passes ] in ``memctl.codecs.channels``),
        the same values; None where that kernel does not apply (not a float32 CPU record of at
        least 2 dimensions, a non-finite value in it, vectors that do not match dimension 1, a
        mask of another size), and the caller decodes and maps the tensor itself. ``floor``:
        :func:`~memctl.codecs.base.mask_floor` of float32 by default; ``-inf`` zeroes the values
        off the mask and leaves the others as mapped."""
        bits, group = _record_params(p)
        if p.dtype is not torch.float32 or len(p.shape) < 2 or p.numel == 0 or p.buffers["exc_index"].numel():
            return None
        if _backend.resolve_impl(None, p.device) is not Impl.CPU:
            return None
        channels = int(p.shape[1])
        vectors = [v.reshape(-1) for v in (sub, scale, shift)]
        if any(v.device.type != "cpu" or v.dtype is not torch.float32 or v.numel() != channels
               or not v.is_contiguous() for v in vectors):
            return None
        n = p.numel
        if mask_bits is not None and (mask_bits.device.type != "cpu" or mask_bits.dtype is not torch.uint8
                                      or mask_bits.numel() != -(-n // 8) or not mask_bits.is_contiguous()):
            return None
        inner = n // (int(p.shape[0]) * channels)
        sub, scale, shift = vectors
        flat = _quantize_kernels.decode_affine_cpu(
            p.buffers["payload"], p.buffers["meta"], bits, group, n, sub, scale, shift, inner, mask_bits,
            mask_floor(torch.float32) if floor is None else floor,
        )
        return flat.reshape(p.shape)

    def _run_decode(
        self, chosen: Impl, payload: torch.Tensor, meta: torch.Tensor, bits: int, group: int, n: int,
        mask: torch.Tensor | None = None, floor: float = 0.0,
    ) -> torch.Tensor:
        if chosen is Impl.CPU:
            return _quantize_kernels.decode_cpu(payload, meta, bits, group, n, mask, floor)
        if chosen is Impl.CUDA:
            return self._cuda.run(
                lambda: _quantize_kernels.decode_cuda(payload, meta, bits, group, n, mask, floor),
                lambda: _reference.decode(payload, meta, bits, group, n, mask, floor),
            )
        return _reference.decode(payload, meta, bits, group, n, mask, floor)


def _mask_bits(mask: object, p: Packed) -> torch.Tensor:
    """The packed bits (``ceil(n / 8)`` uint8 on ``p``'s device) of a decode mask, validated."""
    if isinstance(mask, Packed):
        if mask.codec != "lossless" or mask.dtype is not torch.bool or "payload" not in mask.buffers:
            raise CodecError(
                f"mask must be a lossless record of a bool tensor, got a {mask.codec!r} record of "
                f"{mask.dtype}; encode it with codecs.get('lossless').encode(t > 0)"
            )
        numel, bits = mask.numel, mask.buffers["payload"]
    elif isinstance(mask, torch.Tensor) and mask.dtype is torch.bool:
        from memctl.codecs.lossless import _reference as _lossless_reference

        numel, bits = mask.numel(), _lossless_reference.pack(mask.detach().reshape(-1).contiguous())
    else:
        raise CodecError(
            f"mask must be a bool tensor or a lossless record of one, got {type(mask).__name__}"
            f"{' of ' + str(mask.dtype) if isinstance(mask, torch.Tensor) else ''}; pass t > 0"
        )
    if numel != p.numel:
        raise CodecError(
            f"mask has {numel} values but the record holds {p.numel} ({tuple(p.shape)}); "
            "pass the mask of the same tensor"
        )
    return bits.to(p.device).contiguous()


def _record_params(p: Any) -> tuple[int, int]:
    """``(bits, group_size)`` of a quantize record, validated."""
    if not isinstance(p, Packed) or p.codec != _NAME:
        got = p.codec if isinstance(p, Packed) else type(p).__name__
        raise CodecError(f"'quantize' decodes its own Packed records, got {got!r}; use codecs.decode(p)")
    missing = _BUFFERS.difference(p.buffers)
    if missing:
        raise CodecError(f"quantize record lacks buffers {sorted(missing)}; it was not written by encode")
    bits, group = p.params.get("bits"), p.params.get("group_size")
    if type(bits) is int and bits in BITS and type(group) is int and 0 < group <= MAX_GROUP_SIZE \
            and not group % 8:  # what the checks below accept, without their calls (every decode)
        return bits, group
    try:
        bits = _check_bits(p.params.get("bits"))
        group = _check_group_size(p.params.get("group_size"))
    except (CodecError, ConfigError) as exc:
        raise CodecError(f"quantize record has invalid params {dict(p.params)}: {exc}") from None
    return bits, group
