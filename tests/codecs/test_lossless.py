"""The ``lossless`` codec: exact round trips, bit-packed bools, byte-identical implementations."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memctl.codecs import decode, get
from memctl.codecs.base import Packed
from memctl.codecs.lossless import _kernels as _lossless_kernels
from memctl.codecs.lossless.codec import LosslessCodec
from memctl.errors import CodecError

_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
)
_SHAPES = [(), (0,), (1,), (7,), (8,), (9,), (3, 0), (5, 13), (2, 3, 11), (200,)]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        if x.numel() > 2 and dtype.is_floating_point:
            flat = x.view(-1)
            flat[0], flat[1] = math.nan, -math.inf
        return x
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype is torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@settings(deadline=None, max_examples=30)
@given(st.sampled_from(_DTYPES), st.sampled_from(_SHAPES), st.integers(0, 2**16), st.booleans())
def test_round_trip_is_exact_for_every_dtype(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int, transpose: bool
) -> None:
    x = _tensor(dtype, shape, seed)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, -1)
    codec = LosslessCodec()
    ref = codec.encode(x, impl="reference")
    cpu = codec.encode(x, impl="cpu")
    assert ref.to_bytes() == cpu.to_bytes()
    for p in (ref, cpu):
        for impl in ("reference", "cpu"):
            y = codec.decode(p, impl=impl)
            assert y.device == x.device and _same(y, x)
    assert ref.nbytes == sum(b.numel() * b.element_size() for b in ref.buffers.values())


@pytest.mark.parametrize("n", [0, 1, 8, 13, 64, 1001])
def test_bools_take_one_bit_each(n: int) -> None:
    mask = torch.rand(n) > 0.3
    p = get("lossless").encode(mask)
    assert p.nbytes == math.ceil(n / 8)
    payload = p.buffers["payload"]
    assert payload.dtype == torch.uint8
    expected = [sum(int(mask[8 * k + j]) << j for j in range(min(8, n - 8 * k))) for k in range(len(payload))]
    assert payload.tolist() == expected  # LSB first, tail bits 0
    assert torch.equal(decode(p), mask)


@pytest.mark.parametrize("n", [_lossless_kernels.SERIAL_BELOW - 3, _lossless_kernels.SERIAL_BELOW + 13])
def test_parallel_and_serial_bool_kernels_match_reference(n: int) -> None:
    mask = torch.rand(n) > 0.5
    codec = LosslessCodec()
    ref, cpu = codec.encode(mask, impl="reference"), codec.encode(mask, impl="cpu")
    assert ref.to_bytes() == cpu.to_bytes()
    assert torch.equal(codec.decode(cpu, impl="cpu"), mask)


def test_other_dtypes_store_raw_bytes() -> None:
    x = torch.randn(10, 3, dtype=torch.float64)
    p = get("lossless").encode(x)
    assert p.nbytes == x.numel() * x.element_size()
    assert p.ratio == 1.0


def test_record_and_result_are_copies() -> None:
    for x in (torch.randn(6, 4), torch.rand(40) > 0.5):
        p = get("lossless").encode(x)
        kept = x.clone()
        x.zero_() if x.dtype is not torch.bool else x.fill_(False)
        y = decode(p)
        assert _same(y, kept)
        y.zero_() if y.dtype is not torch.bool else y.fill_(True)
        assert _same(decode(p), kept)


def test_bad_arguments() -> None:
    codec = get("lossless")
    with pytest.raises(CodecError, match="bits=2"):
        codec.encode(torch.randn(3), bits=2)
    with pytest.raises(CodecError, match=r"error_bound=0\.1"):
        codec.encode(torch.randn(3), error_bound=0.1)
    with pytest.raises(CodecError, match="ndarray"):
        codec.encode(torch.randn(3).numpy())  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="seed=-3"):
        codec.encode(torch.randn(3), seed=-3)
    with pytest.raises(CodecError, match="layout"):
        codec.encode(torch.eye(3).to_sparse())
    q = get("quantize").encode(torch.randn(4))
    with pytest.raises(CodecError, match="quantize"):
        codec.decode(q)
    empty = Packed("lossless", (2,), torch.float32, torch.device("cpu"), {}, {})
    with pytest.raises(CodecError, match="payload"):
        codec.decode(empty)


@pytest.mark.cudasim
@pytest.mark.parametrize("shape", [(0,), (1,), (13,), (3, 70)])
def test_reference_and_cuda_kernel_are_byte_identical(shape: tuple[int, ...]) -> None:
    codec = LosslessCodec()
    for x in (_tensor(torch.bool, shape, 1), _tensor(torch.float16, shape, 2)):
        ref = codec.encode(x, impl="reference")
        sim = codec.encode(x, impl="cuda")
        assert ref.to_bytes() == sim.to_bytes()
        assert _same(codec.decode(sim, impl="cuda"), x)
        assert _same(codec.decode(ref, impl="cuda"), x)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.int16, torch.int32, torch.int64]),
    n=st.integers(0, 700),
    lo=st.integers(-(2**63), 2**63 - 1),
    span=st.sampled_from([0, 1, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**62]),
    seed=st.integers(0, 2**16),
)
def test_integers_narrow_exactly(dtype: torch.dtype, n: int, lo: int, span: int, seed: int) -> None:
    info = torch.iinfo(dtype)
    lo = max(info.min, min(lo, info.max))
    hi = min(info.max, lo + span)
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo)).to(torch.int64)
    x = (x + lo).clamp(lo, hi).to(dtype)
    if n:
        x[0] = lo
        x[-1] = hi
    codec = LosslessCodec()
    p = codec.encode(x)
    assert torch.equal(codec.decode(p), x)
    assert p.nbytes == sum(b.numel() * b.element_size() for b in p.buffers.values())
    width = hi - lo
    if n >= 64 and width < 2**8 and dtype is not torch.int8:
        assert p.params["layout"] == "narrow8"
        assert p.nbytes == n + 8


def test_maxpool_indices_shrink_32x() -> None:
    x = torch.randn(4, 8, 16, 16)
    _, idx = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
    p = LosslessCodec().encode(idx)
    assert p.params["layout"] == "window"
    assert p.nbytes == 2 * idx.numel() // 8  # 2 bits per index of a 2x2 window
    assert torch.equal(LosslessCodec().decode(p), idx)


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation", "ceil_mode", "bits"),
    [(2, 2, 0, 1, False, 2), (2, 2, 0, 1, True, 2), (3, 2, 1, 1, False, 4), (3, 2, 0, 1, True, 4),
     (3, 1, 1, 1, False, 4), (2, 1, 0, 1, False, 2), (4, 4, 0, 1, False, 4), (2, 2, 0, 2, False, 4)],
)
@pytest.mark.parametrize("size", [(9, 9), (16, 17), (57, 56)])
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_pooling_indices_store_their_window_position(kernel: int, stride: int, padding: int, dilation: int,
                                                     ceil_mode: bool, bits: int, size: tuple[int, int],
                                                     impl: str) -> None:
    g = torch.Generator().manual_seed(kernel * 100 + stride * 10 + padding + size[0])
    x = torch.randn(4, 8, *size, generator=g)
    _, idx = torch.nn.functional.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode=ceil_mode,
                                            return_indices=True)
    codec = LosslessCodec()
    p = codec.encode(idx, impl=impl)
    assert p.params["layout"] == "window"
    assert p.params["bits"] == bits
    assert p.nbytes == bits * -(-idx.numel() // 8)
    assert torch.equal(codec.decode(p, impl=impl), idx)
    assert p.to_bytes() == codec.encode(idx, impl="reference").to_bytes()


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=3, max_size=4).map(tuple),
    high=st.sampled_from([2, 4, 9, 30, 300, 2**40]),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_integer_tensors_that_look_like_indices_round_trip_exactly(
    shape: tuple[int, ...], high: int, dtype: torch.dtype, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, min(high, torch.iinfo(dtype).max), shape, generator=g, dtype=torch.int64).to(dtype)
    codec = LosslessCodec()
    p = codec.encode(x)
    back = codec.decode(p)
    assert back.dtype == x.dtype
    assert torch.equal(back, x)


def test_indices_outside_any_window_keep_the_narrowed_layout() -> None:
    x = torch.randn(2, 3, 16, 16)
    _, idx = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
    idx = idx.clone()
    idx[1, 2, 3, 4] = 255  # the last value of the plane: outside output (3, 4)'s window
    p = LosslessCodec().encode(idx)
    assert p.params["layout"] == "narrow8"
    assert torch.equal(LosslessCodec().decode(p), idx)


@pytest.mark.cudasim
def test_cuda_compile_failure_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("libdevice not found (simulated)")

    monkeypatch.setattr(_lossless_kernels, "pack_cuda", broken)
    monkeypatch.setattr(_lossless_kernels, "unpack_cuda", broken)
    codec = LosslessCodec()
    mask = torch.arange(300) % 3 == 0
    with pytest.warns(RuntimeWarning, match=r"memctl\[cuda12\]"):
        p = codec.encode(mask, impl="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = codec.decode(p, impl="cuda")
    assert p.to_bytes() == codec.encode(mask, impl="reference").to_bytes()
    assert torch.equal(back, mask)


def test_a_geometry_that_fitted_skips_its_first_plane_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Window codes ]: each check reads the tensor back (a wait for a GPU); a geometry that
    has fitted a whole tensor is checked on the whole tensor only, with the same record."""
    from memctl.codecs.lossless import _window

    monkeypatch.setattr(_window, "_FITTED", set())
    checks: list[int] = []
    fits = _window._fits

    def counting(planes: torch.Tensor, w: Any) -> bool:
        checks.append(planes.dim())
        return fits(planes, w)

    monkeypatch.setattr(_window, "_fits", counting)
    g = torch.Generator().manual_seed(5)
    records = []
    per_encode = []
    for _ in range(2):
        _, idx = torch.nn.functional.max_pool2d(torch.randn(2, 4, 16, 16, generator=g), 2, 2,
                                                return_indices=True)
        before = len(checks)
        records.append((LosslessCodec().encode(idx), idx))
        per_encode.append(len(checks) - before)
    assert per_encode[0] >= 1 and per_encode[1] == 0 and len(_window._FITTED) == 1
    for p, idx in records:
        assert p.params["layout"] == "window" and p.params["bits"] == 2
        assert torch.equal(LosslessCodec().decode(p), idx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [64, 65, 1001])
def test_two_valued_floats_take_one_bit_each(dtype: torch.dtype, n: int) -> None:
    """A CPU dropout's mask (zeros and 1/(1-p)): one bit a value and the two values (NOTE [
    Two-valued floats ]), byte-identical between the kernel and the reference, exact."""
    g = torch.Generator().manual_seed(n)
    mask = ((torch.rand(n, generator=g) > 0.1).to(dtype) / 0.9).reshape(1, n)
    codec = LosslessCodec()
    cpu, ref = codec.encode(mask, impl="cpu"), codec.encode(mask, impl="reference")
    assert cpu.params["layout"] == "two" and cpu.to_bytes() == ref.to_bytes()
    assert cpu.nbytes == math.ceil(n / 8) + 2 * mask.element_size()
    for p in (cpu, ref):
        assert _same(codec.decode(p, impl="cpu"), mask) and _same(codec.decode(p, impl="reference"), mask)
    assert codec.two_valued(mask) is not None
    assert codec.two_valued(torch.randn(n).to(dtype)) is None


@pytest.mark.parametrize("values", [(0.0, -0.0), (math.nan, 1.0), (-math.inf, 0.0), (3.5, 3.5)])
def test_two_valued_floats_keep_their_bit_patterns(values: tuple[float, float]) -> None:
    """Values are told apart by their bit patterns: a signed zero, a NaN and an infinity come
    back as they were; one value alone is two-valued too."""
    x = torch.tensor(values * 50)
    codec = LosslessCodec()
    for impl in ("cpu", "reference"):
        p = codec.encode(x, impl=impl)
        assert p.params["layout"] == "two"
        assert _same(codec.decode(p), x)


def test_a_third_value_anywhere_keeps_the_raw_layout() -> None:
    x = torch.zeros(200)
    x[::3] = 2.0
    for place in (1, 64, 199):
        y = x.clone()
        y[place] = 5.0
        for impl in ("cpu", "reference"):
            p = LosslessCodec().encode(y, impl=impl)
            assert p.params["layout"] == "raw" and _same(decode(p), y)
