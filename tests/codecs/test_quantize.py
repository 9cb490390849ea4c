"""The ``quantize`` codec: round trips, the error bound, unbiasedness, byte-identical implementations."""

from __future__ import annotations

import dataclasses
import math
import random
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memctl.codecs import _rng, decode, get
from memctl.codecs.base import Packed
from memctl.codecs.quantize import _kernels as _quantize_kernels
from memctl.codecs.quantize import _reference as quantize_reference
from memctl.codecs.quantize.codec import QuantizeCodec, QuantizeConfig, group_at, packed_nbytes
from memctl.errors import CodecError, ConfigError

BITS = (1, 2, 4, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SETTINGS = settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])

# Magnitudes that stress the arithmetic: ordinary, huge, tiny normal, denormal.
_SCALES = (1.0, 1e38, 1e-36, 1e-42, 3.0e4)


def _inputs(draw: st.DrawFn) -> torch.Tensor:
    """A float tensor of a drawn shape, scale and pattern, with optional NaN/±Inf."""
    shape = draw(
        st.sampled_from([(), (0,), (1,), (7,), (3, 0), (33,), (300,), (5, 13), (2, 3, 40), (600,)])
    )
    n = math.prod(shape)
    kind = draw(st.sampled_from(["normal", "constant", "zeros", "uniform", "mixed_sign"]))
    scale = draw(st.sampled_from(_SCALES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if kind == "normal":
        x = torch.randn(n, generator=gen, dtype=torch.float64) * scale
    elif kind == "constant":
        x = torch.full((n,), draw(st.sampled_from([1.0, -2.5, 0.0])) * scale, dtype=torch.float64)
    elif kind == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
    elif kind == "uniform":
        x = torch.rand(n, generator=gen, dtype=torch.float64) * scale
    else:
        x = (torch.rand(n, generator=gen, dtype=torch.float64) - 0.5) * 3.0 * scale
    x = x.clamp(-3.0e38, 3.0e38).to(torch.float32)
    if n and draw(st.booleans()):
        specials = draw(st.lists(st.sampled_from([math.nan, math.inf, -math.inf]), min_size=1, max_size=4))
        for k, v in enumerate(specials):
            x[(k * 7919) % n] = v
    return x.reshape(shape)


@st.composite
def _cases(draw: st.DrawFn) -> tuple[torch.Tensor, int, int]:
    x = _inputs(draw)
    dtype = draw(st.sampled_from(DTYPES))
    if dtype is not torch.float32:
        x = x.to(dtype)
    if x.dim() >= 2 and draw(st.booleans()):
        x = x.transpose(0, -1)  # non-contiguous
    elif x.dim() == 1 and x.numel() > 4 and draw(st.booleans()):
        x = x[::2]  # strided slice
    return x, draw(st.sampled_from(BITS)), draw(st.sampled_from([8, 16, 64, 256]))


def _check_bound(x: torch.Tensor, y: torch.Tensor, p: Packed, bits: int) -> None:
    """Every finite value is within one step of its group (+ rounding to the output dtype)."""
    flat = x.detach().reshape(-1).float()
    out = y.reshape(-1).float()
    meta = p.buffers["meta"].double()
    group = int(p.params["group_size"])
    step = ((meta[:, 1] - meta[:, 0]) / ((1 << bits) - 1)).repeat_interleave(group)[: flat.numel()]
    finite = torch.isfinite(flat)
    assert torch.isfinite(out[finite]).all(), "a finite input decoded to a non-finite value"
    err = (out.double() - flat.double()).abs()
    info = torch.finfo(x.dtype)
    # Half an ulp of the output dtype at the decoded value, a few float32 ulps, one denormal step.
    ulp = out.double().abs() * info.eps + flat.double().abs() * 4 * torch.finfo(torch.float32).eps
    tol = step * (1 + 1e-6) + ulp + info.smallest_normal * info.eps + 1e-45
    assert bool((err[finite] <= tol[finite]).all()), float((err - tol)[finite].max())
    # Non-finite values come back in place and never finite.
    nonfinite = ~finite
    assert torch.equal(out[nonfinite].isnan(), flat[nonfinite].isnan())
    assert torch.equal(out[nonfinite & ~flat.isnan()], flat[nonfinite & ~flat.isnan()])


@_SETTINGS
@given(_cases())
def test_round_trip_preserves_layout_and_error_bound(case: tuple[torch.Tensor, int, int]) -> None:
    x, bits, group = case
    codec = QuantizeCodec(group_size=group)
    p = codec.encode(x, bits=bits, seed=7)
    y = codec.decode(p)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert y.is_contiguous()
    _check_bound(x, y, p, bits)
    assert p.nbytes == sum(b.numel() * b.element_size() for b in p.buffers.values())


@_SETTINGS
@given(_cases(), st.integers(0, 2**32 - 1))
def test_reference_and_cpu_kernel_are_byte_identical(case: tuple[torch.Tensor, int, int], seed: int) -> None:
    x, bits, group = case
    codec = QuantizeCodec(group_size=group)
    ref = codec.encode(x, bits=bits, seed=seed, impl="reference")
    cpu = codec.encode(x, bits=bits, seed=seed, impl="cpu")
    assert ref.to_bytes() == cpu.to_bytes()
    a, b = codec.decode(ref, impl="reference"), codec.decode(cpu, impl="cpu")
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("numel", [_quantize_kernels.SERIAL_BELOW - 1, _quantize_kernels.SERIAL_BELOW + 300])
def test_parallel_and_serial_cpu_kernels_match_reference(numel: int) -> None:
    """Large tensors take the parallel kernel, small ones its serial compilation: both match."""
    x = torch.randn(numel) * torch.logspace(-20, 20, 9)[torch.arange(numel) % 9]
    x[[0, 777, numel - 1]] = torch.tensor([math.nan, math.inf, -math.inf])
    codec = QuantizeCodec()
    for bits in (1, 2, 4, 8):
        ref = codec.encode(x, bits=bits, seed=11, impl="reference")
        cpu = codec.encode(x, bits=bits, seed=11, impl="cpu")
        assert ref.to_bytes() == cpu.to_bytes()
        assert torch.equal(codec.decode(cpu).nan_to_num(), codec.decode(ref, impl="reference").nan_to_num())


def test_reference_in_small_chunks_writes_the_same_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantize_reference, "_REF_CHUNK", 64)  # chunks of whole groups: 2 groups of 24
    x = torch.randn(1000)
    x[500] = math.nan
    codec = QuantizeCodec(group_size=24)
    for bits in BITS:
        ref = codec.encode(x, bits=bits, seed=3, impl="reference")
        assert ref.to_bytes() == codec.encode(x, bits=bits, seed=3, impl="cpu").to_bytes()
        assert torch.equal(codec.decode(ref, impl="reference").nan_to_num(), codec.decode(ref).nan_to_num())


@pytest.mark.parametrize(
    ("bits", "scale"),
    [(1, 1.0), (2, 1.0), (4, 1.0), (8, 1.0), (2, 2.0**120), (8, 2.0**120), (2, 2.0**-140), (8, 2.0**-140)],
)
def test_unbiased_over_seeds(bits: int, scale: float) -> None:
    """Mean error over 2000 seeds within 4 standard errors of 0, per value; huge and denormal too.

    The standard error is the exact one of stochastic rounding, ``step * sqrt(p (1 - p) / N)``
    with ``p`` the value's fractional position between two levels.
    """
    big = (1 << bits) - 1
    # Group 0: exact levels (range [0, B], step 1); group 1: an inexact range. Fractions across the step.
    exact = [0.0, float(big), 0.3, 0.5, 0.77, big - 0.01, big * 0.61, 0.05]
    inexact = [-1.3, 2.9, 0.123, -0.777, 1.5, 2.8999, 0.0, 1e-3]
    x = (torch.tensor(exact + inexact, dtype=torch.float64) * scale).to(torch.float32)
    codec = QuantizeCodec(group_size=8)
    seeds = 2000
    errors = torch.stack(
        [codec.decode(codec.encode(x, bits=bits, seed=s)).double() - x.double() for s in range(seeds)]
    )
    x64 = x.double().reshape(2, 8)
    lo = x64.min(dim=1, keepdim=True).values
    step = ((x64.max(dim=1, keepdim=True).values - lo) / big).expand(2, 8)
    position = (x64 - lo) / step
    p = (position - position.floor()).reshape(-1)
    step = step.reshape(-1)
    se = step * torch.sqrt(p * (1 - p) / seeds)
    slack = x.double().abs() * 2 * torch.finfo(torch.float32).eps + 2.0**-149
    mean = errors.mean(dim=0)
    assert bool((mean.abs() <= 4 * se + slack).all()), (bits, mean, se)
    # Each value lands on one of its two neighbouring levels.
    assert bool((errors.abs() <= step * (1 + 1e-6)).all())


def test_rounding_uses_both_neighbours_and_seed_matters() -> None:
    x = torch.full((256,), 0.5)
    x[0], x[1] = 0.0, 1.0  # range [0, 1] at 1 bit: 0.5 rounds to 0 or 1 with probability 1/2
    codec = QuantizeCodec()
    y = codec.decode(codec.encode(x, bits=1, seed=3))
    share = float((y[2:] == 1.0).double().mean())
    assert 0.35 < share < 0.65
    a, b = codec.encode(x, bits=1, seed=3), codec.encode(x, bits=1, seed=4)
    assert a.to_bytes() == codec.encode(x, bits=1, seed=3).to_bytes()
    assert a.to_bytes() != b.to_bytes()


def test_extreme_ranges_stay_finite_and_exact_metadata() -> None:
    x = torch.tensor([3.4e38, -3.4e38, 1e-45, -1e-45, 0.0, 1e38, -1e38, 5.0] * 4)
    for bits in BITS:
        p = get("quantize").encode(x, bits=bits)
        y = decode(p)
        assert torch.isfinite(y).all()
        assert p.buffers["meta"][0].tolist() == [x.min().item(), x.max().item()]
        _check_bound(x, y, p, bits)


def test_metadata_layout_and_padding() -> None:
    x = torch.arange(20, dtype=torch.float32) - 5.0
    x[19] = math.nan
    p = QuantizeCodec(group_size=8).encode(x, bits=4)
    assert p.buffers["meta"].shape == (3, 2) and p.buffers["meta"].dtype == torch.float32
    assert p.buffers["meta"].tolist() == [[-5.0, 2.0], [3.0, 10.0], [11.0, 13.0]]
    assert p.buffers["payload"].numel() == 3 * 8 * 4 // 8
    assert p.buffers["payload"][-2:].tolist() == [0, 0]  # padding codes
    assert int(p.buffers["payload"][-3]) >> 4 == 0  # the NaN's code
    assert p.buffers["exc_index"].tolist() == [19]
    assert math.isnan(p.buffers["exc_value"].item())


def test_negative_zero_is_canonical() -> None:
    x = torch.tensor([-0.0] * 8 + [-0.0, -1.0] * 4)
    for impl in ("reference", "cpu"):
        meta = QuantizeCodec(group_size=8).encode(x, impl=impl).buffers["meta"]
        signs = [math.copysign(1.0, v) for v in meta.reshape(-1).tolist() if v == 0.0]
        assert signs == [1.0, 1.0, 1.0]


def test_all_non_finite_group_stores_zeros() -> None:
    x = torch.tensor([math.nan, math.inf, -math.inf, math.nan] * 2 + [1.0] * 8)
    for impl in ("reference", "cpu"):
        p = QuantizeCodec(group_size=8).encode(x, bits=2, impl=impl)
        assert p.buffers["meta"][0].tolist() == [0.0, 0.0]
        y = decode(p)
        assert torch.equal(y.isnan(), x.isnan()) and torch.equal(y.isinf(), x.isinf())
        assert torch.equal(y[8:], x[8:])


@pytest.mark.parametrize("numel", [0, 1, 255, 256, 257, 10_000])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", [8, 24, 256])
def test_packed_nbytes_matches_records(numel: int, bits: int, group: int) -> None:
    p = QuantizeCodec(group_size=group).encode(torch.randn(numel), bits=bits)
    assert p.nbytes == packed_nbytes(numel, bits, group)
    assert p.nbytes == sum(b.numel() * b.element_size() for b in p.buffers.values())


def test_nbytes_counts_exceptions_and_ratio() -> None:
    x = torch.randn(4096)
    x[[5, 9]] = math.nan
    p = get("quantize").encode(x, bits=2)
    assert p.nbytes == packed_nbytes(4096, 2, 256) + 2 * (8 + 4)
    big = get("quantize").encode(torch.randn(1 << 16), bits=2)
    assert big.ratio >= 14.0


def test_record_params_and_config_travel() -> None:
    codec = get("quantize", group_size=128, bits=4)
    assert isinstance(codec, QuantizeCodec) and codec.config == QuantizeConfig(group_size=128, bits=4)
    x = torch.randn(1000)
    p = codec.encode(x)
    assert p.params["bits"] == 4 and p.params["group_size"] == 128
    y = decode(p)  # a default-configured codec reads group size and bits from the record
    _check_bound(x, y, p, 4)
    assert torch.equal(y, codec.decode(p))
    with pytest.raises(dataclasses.FrozenInstanceError):
        codec.config.group_size = 64  # type: ignore[misc]


def test_reference_runs_on_non_contiguous_input_and_copies() -> None:
    base = torch.randn(64, 48)
    x = base.t()[:, ::3]
    p = get("quantize").encode(x, bits=8, impl="reference")
    before = decode(p)
    base.mul_(100.0)  # the record is a copy: later in-place changes do not reach it
    assert torch.equal(decode(p), before)
    assert before.shape == x.shape


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"bits": 3}, CodecError, "bits=3"),
        ({"bits": True}, CodecError, "bits=True"),
        ({"error_bound": 0.1}, CodecError, "errorbound"),
        ({"seed": -1}, CodecError, "seed=-1"),
        ({"seed": 2**32}, CodecError, "2**32"),
        ({"seed": 1.5}, CodecError, "seed=1.5"),
        ({"impl": "gpu"}, CodecError, "impl='gpu'"),
    ],
)
def test_bad_encode_arguments(kwargs: dict[str, object], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words.replace("*", r"\*").replace("(", r"\(")):
        get("quantize").encode(torch.randn(10), **kwargs)  # type: ignore[arg-type]


def test_bad_inputs_and_config() -> None:
    codec = get("quantize")
    with pytest.raises(CodecError, match=r"torch\.int64"):
        codec.encode(torch.arange(5))
    with pytest.raises(CodecError, match="list"):
        codec.encode([1.0, 2.0])  # type: ignore[arg-type]
    for bad in (0, -8, 12, 7.5, True):
        with pytest.raises(ConfigError, match="group_size"):
            QuantizeCodec(group_size=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="bits=5"):
        QuantizeCodec(bits=5)
    with pytest.raises(ConfigError, match="numel"):
        packed_nbytes(-1, 2, 256)
    with pytest.raises(CodecError, match="bits=16"):
        packed_nbytes(10, 16, 256)


def test_decode_rejects_foreign_or_damaged_records() -> None:
    codec = get("quantize")
    p = codec.encode(torch.randn(16))
    other = get("lossless").encode(torch.randn(4))
    with pytest.raises(CodecError, match="lossless"):
        codec.decode(other)
    damaged = Packed(p.codec, p.shape, p.dtype, p.device, p.buffers, {**p.params, "bits": 3})
    with pytest.raises(CodecError, match="invalid params"):
        codec.decode(damaged)
    partial = Packed(p.codec, p.shape, p.dtype, p.device, {"payload": p.buffers["payload"]}, p.params)
    with pytest.raises(CodecError, match="lacks buffers"):
        codec.decode(partial)


@pytest.mark.cudasim
@pytest.mark.parametrize(
    ("bits", "group", "numel", "specials"),
    [(1, 64, 200, True), (2, 256, 520, True), (4, 16, 90, False), (8, 8, 37, True), (2, 64, 0, False)],
)
def test_reference_and_cuda_kernel_are_byte_identical(
    bits: int, group: int, numel: int, specials: bool
) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + numel)
    x = torch.randn(numel, generator=gen) * 10.0
    if specials:
        x[[1, numel // 2]] = torch.tensor([math.inf, math.nan])
        x[3] = -0.0
    codec = QuantizeCodec(group_size=group)
    ref = codec.encode(x, bits=bits, seed=99, impl="reference")
    sim = codec.encode(x, bits=bits, seed=99, impl="cuda")
    assert ref.to_bytes() == sim.to_bytes()
    assert torch.equal(codec.decode(sim, impl="cuda").nan_to_num(), codec.decode(ref).nan_to_num())


@pytest.mark.cudasim
def test_cuda_compile_failure_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("libdevice not found (simulated)")

    monkeypatch.setattr(_quantize_kernels, "encode_cuda", broken)
    monkeypatch.setattr(_quantize_kernels, "decode_cuda", broken)
    codec = QuantizeCodec()
    x = torch.randn(300)
    with pytest.warns(RuntimeWarning, match=r"memctl\[cuda12\]"):
        p = codec.encode(x, impl="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = codec.decode(p, impl="cuda")
        codec.encode(x, impl="cuda")
    assert p.to_bytes() == codec.encode(x, impl="reference").to_bytes()
    assert torch.equal(y, codec.decode(p, impl="reference"))

    def buggy(*args: object) -> None:
        raise ValueError("a bug, not a compile failure")

    monkeypatch.setattr(_quantize_kernels, "encode_cuda", buggy)
    with pytest.raises(ValueError, match="a bug"):
        QuantizeCodec().encode(x, impl="cuda")


def test_hash_is_the_same_function_everywhere() -> None:
    """PyTorch, Python ints and the Numba source (run as Python) agree, above 2**32 too."""
    rnd = random.Random(5)
    index = [0, 1, 2**32 - 1, 2**32, 2**32 + 5, 2**40 + 3] + [rnd.getrandbits(40) for _ in range(200)]
    for seed in (0, 1, 2**32 - 1, rnd.getrandbits(32)):
        hashed = _rng.hash_torch(seed, torch.tensor(index, dtype=torch.int64)).tolist()
        for i, h in zip(index, hashed, strict=True):
            key = _rng.key_int(seed, i >> 32)
            assert h == _rng.lowbias32_int((i & _rng.MASK32) ^ key)
            assert h == int(_rng.lowbias32_numba(np.uint64((i & _rng.MASK32) ^ key)))
    assert _rng.lowbias32_int(0) == 0 and _rng.lowbias32_int(1) != 1


@pytest.mark.parametrize("impl", ["cpu", "reference"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_encode_into_writes_encodes_bytes_in_place(impl: str, bits: int) -> None:
    """NOTE [ Batched small records ]: the buffers given hold what encode would allocate."""
    codec = QuantizeCodec(group_size=64)
    t = torch.randn(5 * 64) * 3
    record = codec.encode(t, bits=bits, seed=7, impl=impl)
    groups = 5 * 64 // group_at(bits, 64)  # 20 groups of 16 at 8 bits (NOTE [ Eight-bit groups ])
    payload = torch.full((2 * 5 * 64 * bits // 8,), 0xAB, dtype=torch.uint8)
    meta = torch.zeros((2 * groups, 2))
    # views of larger buffers, as a batch's records are: only their part is written
    assert not codec.encode_into(t, payload[:5 * 64 * bits // 8], meta[:groups], bits=bits, seed=7, impl=impl)
    assert torch.equal(payload[:5 * 64 * bits // 8], record.buffers["payload"])
    assert torch.equal(meta[:groups], record.buffers["meta"])
    assert bool((payload[5 * 64 * bits // 8:] == 0xAB).all()) and bool((meta[groups:] == 0).all())


def test_encode_into_reports_non_finite_values_and_checks_its_buffers() -> None:
    from memctl.errors import CodecError

    codec = QuantizeCodec(group_size=64)
    t = torch.randn(128)
    t[3] = float("nan")
    payload, meta = torch.empty(32, dtype=torch.uint8), torch.empty((2, 2))
    assert codec.encode_into(t, payload, meta, bits=2)
    index, value = codec.exceptions(t)
    assert index.tolist() == [3] and torch.isnan(value).all()
    with pytest.raises(CodecError, match="payload of 32 bytes"):
        codec.encode_into(t, torch.empty(16, dtype=torch.uint8), meta, bits=2)
    with pytest.raises(CodecError, match="bits=3"):
        codec.encode_into(t, payload, meta, bits=3)


@pytest.mark.parametrize("bits", [1, 2, 8])
@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_float64_goes_through_float32_and_keeps_what_float32_cannot_hold(bits: int, impl: str) -> None:
    """NOTE [ Float64 through float32 ]: the record of the float32 values, decoded to float64;
    values outside float32's range come back exactly, with the non-finite ones."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=g, dtype=torch.float64)
    special = {5: 1e300, 7: float("nan"), 9: -1e39, 11: float("inf"), 13: 3e38}
    for i, v in special.items():
        x[i] = v
    codec = get("quantize")
    p = codec.encode(x, bits=bits, seed=3, impl=impl)
    same = codec.encode(x.float().clamp(-3.4e38, 3.4e38), bits=bits, seed=3, impl=impl)
    y = codec.decode(p)
    assert y.dtype is torch.float64 and y.shape == x.shape
    for i in (5, 9, 11):
        assert y[i].item() == x[i].item()
    assert math.isnan(y[7].item())
    assert p.buffers["exc_value"].dtype is torch.float64
    # the finite values: float32's record, byte for byte (beyond the out-of-range ones' groups)
    ordinary = [k for k in range(1, p.buffers["meta"].shape[0])]
    assert torch.equal(p.buffers["meta"][ordinary], same.buffers["meta"][ordinary])
    finite = torch.isfinite(x) & (x.abs() < 1e30)
    step = float(x[finite].max() - x[finite].min())
    assert (y[finite] - x[finite]).abs().max().item() <= step


def test_a_float64_model_is_compressed() -> None:
    """It was a codec failure on every layer, kept uncompressed with a warning each."""
    from torch import nn

    import memctl

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)).double()
    ctl = memctl.Controller(model, bits=2, monitor_interval_s=0, calibration_fraction=0)
    x, y = torch.randn(256, 64, dtype=torch.float64), torch.randint(0, 10, (256,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            nn.functional.cross_entropy(model(x), y).backward()
            ctl.step()
    s = ctl.stats()
    assert s["fallbacks"] == 0 and s["packed_bytes"] * 8 < s["raw_bytes"]
    ctl.detach()
