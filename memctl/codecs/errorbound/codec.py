"""The ``errorbound`` codec: SZ-style linear quantisation under an absolute error bound.

>>> codec = ErrorBoundCodec()                                  # doctest: +SKIP
>>> p = codec.encode(x, error_bound=1e-3)                      # doctest: +SKIP
>>> ((codec.decode(p).double() - x.double()).abs() <= 1e-3).all()  # doctest: +SKIP

Guarantee: for every finite value, ``|decode(encode(x)) - x| <= error_bound`` after the
decoded value is cast back to the input dtype (float32, float16 or bfloat16), for any
bound > 0; NaN comes back NaN and +-Inf the same Inf, at the same positions; zeros come
back exactly 0. The codec is deterministic (``seed`` is ignored).

NOTE [ errorbound format ]
The flat input is cut into groups of G values (the last may be shorter: its missing
values are simply absent, never stored). Per group, four metadata buffers:
``mode`` (uint8: code width b in bits 0..4, ``MODE_SPARSE`` 0x20, ``MODE_RAW`` 0x40),
``qmin`` (int32), ``step`` (float32) and ``offset`` (int64, the byte where the group's
payload starts in ``payload``, uint8). A group is one of:

* dense: its L codes ``q - qmin``, b bits each, packed LSB first, ceil(L * b / 8) bytes
  (zero bytes when b == 0: a constant group, e.g. all zeros, costs only metadata);
* sparse: an L-bit bitmap of the values with ``q != 0``, then only those values' codes,
  ceil((L + nnz * b) / 8) bytes; chosen when strictly smaller than dense (ReLU outputs);
* raw: the values verbatim in the *input* dtype's bits (16 or 32 per value), NaN and
  Inf included. Storing float16/bfloat16 raw groups at 16 bits instead of as float32
  keeps a tensor whose bound is below its dtype's resolution at its original size.

Payload sizes vary per group, so the offsets are an exclusive prefix sum computed on the
tensor's device (``torch.cumsum``); allocating the payload needs its total size on the
host, which is one scalar device-to-host sync per encoded tensor. That sync is inherent to
variable-rate compression (a fixed-rate format could allocate up front, and would give up
the sparse and constant-group savings). Decoding needs no sync.

NOTE [ errorbound arithmetic ]
Grid anchored at zero, so 0 is a grid point and zeros decode exactly. Per group with
M = max |x| over its values:

* e_g = e for float32. For float16/bfloat16 the final cast of the float32 result adds up
  to half an ulp of the dtype, so e_g = (e - h) * (1 - 2^-40) with
  h = max((M + e) * 2^-p, smallest half-ulp) (p = 11 / 8; 2^-25 / 2^-134); the factor
  keeps the float64 rounding of e - h from rounding up. Clamped to at most 2^126.
* s_g = float32(e_g * (2 - 2^-9)), i.e. 2 e_g (1 - 2^-10), slack for rounding.
* q = floor(x / s_g + 0.5) in float64, only when |x| <= 2^29 s_g, so q * s_g is exact in
  float64; the decoder computes v = float32(float64(q) * float64(s_g)).
* The encoder computes that v for every value and requires |v - x| <= e_g (float64; the
  subtraction is exact here) and |q s_g| <= the dtype's largest finite value (so the
  final cast cannot overflow). Any failure, a non-finite value, e_g <= 0, s_g == 0, or
  b > 24 makes the group raw. The guarantee thus holds by construction.

Every float operation is a single IEEE-754 operation in a fixed precision (no
multiply-add pairs that a compiler could contract into an FMA, no fast-math, no
reciprocal), so the reference, the Numba CPU kernel and the Numba-CUDA kernel write
byte-identical records.

The three codecs' formats side by side: docs/formats.md, "errorbound".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from memctl.codecs import _backend
from memctl.codecs.base import FLOAT_DTYPES, Impl, Packed
from memctl.codecs.errorbound import _reference
from memctl.codecs.errorbound._format import DtypeSpec, dtype_spec
from memctl.errors import CodecError, ConfigError

__all__ = ["ErrorBoundCodec", "bits_for_range"]

_BUFFERS = ("mode", "offset", "payload", "qmin", "step")
_MAX_GROUP_SIZE = 1 << 24  # values per group; offsets and codes are sized for it
# One thread per group: small blocks spread the few threads over many SMs (and keep Numba's
# low-occupancy warning, under 128 blocks, for tensors below 128 * 32 groups only).
_GROUP_THREADS = 32
_VALUE_THREADS = 256


def bits_for_range(value_range: float, error_bound: float) -> int:
    """Bits per value that a group of range R needs at absolute bound e: ceil(log2(R / (2e) + 1)).

    Deterministic rounding with step 2e keeps |x̂ - x| <= e (docs/design.md, "Bits and error bounds").
    """
    if not (math.isfinite(value_range) and value_range >= 0.0):
        raise ConfigError(f"value_range={value_range!r} must be a finite number >= 0 (max - min of a group)")
    _check_bound(error_bound)
    return math.ceil(math.log2(value_range / (2.0 * error_bound) + 1.0))


def _check_bound(error_bound: object) -> float:
    if isinstance(error_bound, bool) or not isinstance(error_bound, int | float):
        raise ConfigError(
            f"error_bound={error_bound!r} must be a float (an absolute bound such as 1e-3)"
        )
    try:
        e = float(error_bound)
    except OverflowError:  # an int beyond float range, e.g. 10**400
        e = math.inf
    if not (math.isfinite(e) and e > 0.0):
        shown = f"an int of {error_bound.bit_length()} bits" if isinstance(error_bound, int) \
            and abs(error_bound) > 2**64 else repr(error_bound)
        raise ConfigError(f"error_bound={shown} must be finite and > 0 (for example 1e-3)")
    return e


@dataclass(frozen=True)
class ErrorBoundCodec:
    """Error-bounded codec; see the module docstring for its guarantee and format.

    Attributes:
        group_size: values per group (a positive multiple of 8); each group has its own
            step, bit width and mode, at 17 bytes of metadata.
    """

    group_size: int = 256
    _cuda: _backend.CudaFallback = field(default_factory=lambda: _backend.CudaFallback("errorbound"),
                                         init=False, repr=False, compare=False)
    name = "errorbound"

    def __post_init__(self) -> None:
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or not 0 < g <= _MAX_GROUP_SIZE or g % 8:
            shown = f"an int of {g.bit_length()} bits" if isinstance(g, int) and abs(g) > 2**64 else repr(g)
            raise ConfigError(
                f"group_size={shown} must be a positive multiple of 8 up to {_MAX_GROUP_SIZE} "
                "(for example 256)"
            )

    def encode(
        self,
        t: torch.Tensor,
        *,
        bits: int | None = None,
        error_bound: float | None = None,
        seed: int = 0,
        impl: Impl | str | None = None,
    ) -> Packed:
        """Compress ``t`` so that every finite value comes back within ``error_bound``.

        ``seed`` is accepted for the common codec signature and ignored (deterministic).
        """
        _backend.require_tensor(t, self.name)
        spec = dtype_spec(t.dtype)
        if spec is None:
            allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
            raise CodecError(
                f"errorbound encodes {allowed} tensors, got {t.dtype}; cast the tensor to a "
                "float dtype or use the 'lossless' codec"
            )
        if bits is not None:
            raise ConfigError(
                f"errorbound takes error_bound=..., not bits={bits!r}; use the 'quantize' codec "
                "for a bit width, or bits_for_range() to turn a range and a bound into bits"
            )
        if error_bound is None:
            raise ConfigError("errorbound needs error_bound=e, an absolute bound > 0 (for example 1e-3)")
        e = _check_bound(error_bound)
        chosen = _backend.resolve_impl(impl, t.device)

        flat = t.detach().reshape(-1).contiguous()
        x32 = flat if flat.dtype == torch.float32 else flat.float()
        xraw = flat.view(spec.raw_int)
        if flat.numel() == 0:
            buffers = _empty_buffers(t.device)
        elif chosen is Impl.REFERENCE:
            buffers = _reference.encode(x32, xraw, self.group_size, e, spec)
        elif chosen is Impl.CPU:
            buffers = _encode_cpu(x32, xraw, self.group_size, e, spec)
        else:
            buffers = self._cuda.run(
                functools.partial(_encode_cuda, x32, xraw, self.group_size, e, spec),
                functools.partial(_reference.encode, x32, xraw, self.group_size, e, spec),
            )
        return Packed(
            codec=self.name,
            shape=tuple(t.shape),
            dtype=t.dtype,
            device=t.device,
            buffers=buffers,
            params={"group_size": self.group_size, "error_bound": e},
        )

    def decode(self, p: Packed, *, impl: Impl | str | None = None) -> torch.Tensor:
        """The tensor ``p`` describes (shape, dtype and device of the original)."""
        group_size, spec = _check_record(p)
        chosen = _backend.resolve_impl(impl, p.device)
        n = p.numel
        buffers = dict(p.buffers)
        if n == 0:
            out = torch.empty(0, dtype=torch.float32, device=p.device)
        elif chosen is Impl.REFERENCE:
            out = _reference.decode(buffers, n, group_size, spec)
        elif chosen is Impl.CPU:
            out = _decode_cpu(buffers, n, group_size, spec)
        else:
            out = self._cuda.run(
                functools.partial(_decode_cuda, buffers, n, group_size, spec, p.device),
                functools.partial(_reference.decode, buffers, n, group_size, spec),
            )
        return out.to(p.dtype).reshape(p.shape)


def _check_record(p: object) -> tuple[int, DtypeSpec]:
    if not isinstance(p, Packed):
        raise CodecError(
            f"'errorbound' decodes its own Packed records, got {type(p).__name__}; pass what encode returned"
        )
    if p.codec != ErrorBoundCodec.name:
        raise CodecError(
            f"record was written by codec {p.codec!r}, not 'errorbound'; decode it with "
            "memctl.codecs.decode(p)"
        )
    missing = [b for b in _BUFFERS if b not in p.buffers]
    group_size = p.params.get("group_size")
    if missing or not isinstance(group_size, int) or group_size <= 0:
        raise CodecError(
            f"errorbound record is incomplete (missing buffers {missing}, group_size={group_size!r}); "
            "it must come from ErrorBoundCodec.encode"
        )
    spec = dtype_spec(p.dtype)
    if spec is None:
        raise CodecError(f"errorbound record has dtype {p.dtype}, which the codec never writes")
    n_groups = -(-p.numel // group_size)
    if p.buffers["mode"].numel() != n_groups:
        raise CodecError(
            f"errorbound record has {p.buffers['mode'].numel()} groups but shape {p.shape} with "
            f"group_size={group_size} needs {n_groups}; the record is corrupt"
        )
    return group_size, spec


def _empty_buffers(device: torch.device) -> dict[str, torch.Tensor]:
    def empty(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(0, dtype=dtype, device=device)

    return {
        "mode": empty(torch.uint8),
        "qmin": empty(torch.int32),
        "step": empty(torch.float32),
        "offset": empty(torch.int64),
        "payload": empty(torch.uint8),
    }


def _plan_outputs(n_groups: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Pass 1's per-group outputs, uninitialised (the kernel writes every entry)."""
    return {
        "mode": torch.empty(n_groups, dtype=torch.uint8, device=device),
        "qmin": torch.empty(n_groups, dtype=torch.int32, device=device),
        "step": torch.empty(n_groups, dtype=torch.float32, device=device),
        "size": torch.empty(n_groups, dtype=torch.int64, device=device),
    }


def _offsets(size: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Exclusive prefix sum of the group sizes, on their device, and the total (a host sync)."""
    offset = torch.cumsum(size, 0) - size
    return offset, int(size.sum())


def _encode_cpu(
    x32: torch.Tensor, xraw: torch.Tensor, group_size: int, e: float, spec: DtypeSpec
) -> dict[str, torch.Tensor]:
    from memctl.codecs.errorbound._kernels import cpu_kernels, cpu_serial_kernels, run

    kernels, serial = cpu_kernels(), cpu_serial_kernels()
    n = x32.numel()
    out = _plan_outputs(-(-n // group_size), x32.device)
    meta = (out["mode"].numpy(), out["qmin"].numpy(), out["step"].numpy())
    run(
        kernels.plan, serial.plan, n, x32.numpy(), n, group_size, e, spec.cast_rel, spec.cast_min,
        spec.shrink, spec.vmax, spec.raw_width, *meta, out["size"].numpy(),
    )
    offset, total = _offsets(out["size"])
    payload = torch.zeros(total, dtype=torch.uint8)
    run(
        kernels.pack, serial.pack, n, x32.numpy(), xraw.numpy(), n, group_size, spec.raw_width, *meta,
        offset.numpy(), payload.numpy(),
    )
    return {**{k: out[k] for k in ("mode", "qmin", "step")}, "offset": offset, "payload": payload}


def _decode_cpu(
    buffers: Mapping[str, torch.Tensor], n: int, group_size: int, spec: DtypeSpec
) -> torch.Tensor:
    from memctl.codecs.errorbound._kernels import cpu_kernels, cpu_serial_kernels, run

    arrays = {k: buffers[k].contiguous().numpy() for k in _BUFFERS}
    out = torch.empty(n, dtype=torch.float32)
    run(
        cpu_kernels().unpack, cpu_serial_kernels().unpack, n, arrays["payload"], n, group_size,
        spec.exp_bits, spec.man_bits,
        arrays["mode"], arrays["qmin"], arrays["step"], arrays["offset"], out.numpy(),
    )
    return out


def _launch(count: int, threads: int) -> tuple[int, int]:
    """(blocks, threads per block) covering ``count`` work items."""
    tpb = min(threads, count)
    return -(-count // tpb), tpb


def _encode_cuda(
    x32: torch.Tensor, xraw: torch.Tensor, group_size: int, e: float, spec: DtypeSpec
) -> dict[str, torch.Tensor]:
    from memctl.codecs.errorbound._kernels import cuda_kernels

    kernels = cuda_kernels()
    device = x32.device
    n = x32.numel()
    n_groups = -(-n // group_size)
    stream = _backend.torch_stream(device)
    blocks, tpb = _launch(n_groups, _GROUP_THREADS)
    d_x = _backend.to_device_array(x32)
    out = _plan_outputs(n_groups, device)
    d_meta = [_backend.to_device_array(out[k]) for k in ("mode", "qmin", "step")]
    d_size = _backend.to_device_array(out["size"])
    kernels.plan[blocks, tpb, stream](
        d_x, n, group_size, e, spec.cast_rel, spec.cast_min, spec.shrink, spec.vmax, spec.raw_width,
        *d_meta, d_size,
    )
    mode, qmin, step, size = (_backend.from_device_array(d, device) for d in (*d_meta, d_size))
    offset, total = _offsets(size)
    payload = torch.zeros(total, dtype=torch.uint8, device=device)
    if total > 0:
        d_payload = _backend.to_device_array(payload)
        kernels.pack[blocks, tpb, stream](
            d_x, _backend.to_device_array(xraw), n, group_size, spec.raw_width,
            *d_meta, _backend.to_device_array(offset), d_payload,
        )
        payload = _backend.from_device_array(d_payload, device)
    return {"mode": mode, "qmin": qmin, "step": step, "offset": offset, "payload": payload}


def _decode_cuda(
    buffers: Mapping[str, torch.Tensor], n: int, group_size: int, spec: DtypeSpec, device: torch.device
) -> torch.Tensor:
    from memctl.codecs.errorbound._kernels import cuda_kernels

    kernels = cuda_kernels()
    payload = buffers["payload"]
    if payload.numel() == 0:  # every group constant: give the kernel a valid (unread) array
        payload = torch.zeros(1, dtype=torch.uint8, device=device)
    d = {k: _backend.to_device_array(buffers[k].contiguous()) for k in ("mode", "qmin", "step", "offset")}
    out = torch.empty(n, dtype=torch.float32, device=device)
    d_out = _backend.to_device_array(out)
    blocks, tpb = _launch(n, _VALUE_THREADS)
    kernels.unpack[blocks, tpb, _backend.torch_stream(device)](
        _backend.to_device_array(payload.contiguous()), n, group_size, spec.exp_bits, spec.man_bits,
        d["mode"], d["qmin"], d["step"], d["offset"], d_out,
    )
    return _backend.from_device_array(d_out, device)
