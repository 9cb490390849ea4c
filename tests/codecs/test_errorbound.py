"""The ``errorbound`` codec: its bound, its format's sizes, and three byte-identical implementations.

Tiers: plain CPU (reference and Numba CPU kernel), the CUDA simulator (``cudasim``: a few
groups only, it runs about 400 values/s) and a real GPU (``gpu``).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import memctl.codecs
from memctl.codecs import _backend
from memctl.codecs.base import Packed
from memctl.codecs.errorbound import _kernels as _errorbound_kernels
from memctl.codecs.errorbound._format import MODE_BITS, MODE_RAW, MODE_SPARSE
from memctl.codecs.errorbound.codec import ErrorBoundCodec, bits_for_range
from memctl.errors import CodecError, ConfigError

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
METADATA_BYTES = 1 + 4 + 4 + 8  # mode, qmin, step, offset per group

SPECIALS = [
    0.0, -0.0, 1.0, -1.0, 0.5, 1e-3, 3.0e38, -3.4e38, 3.4028235e38, 1e-45, -1.4e-45, 1e-40, 1.2e-38,
    65504.0, -65504.0, 6e-8, 1e-5, 1e30, float("nan"), float("inf"), float("-inf"),
]  # fmt: skip


def assert_within_bound(x: torch.Tensor, y: torch.Tensor, e: float) -> None:
    """The codec's promise, checked value by value in float64."""
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    xd, yd = x.detach().double().cpu(), y.double().cpu()
    assert torch.equal(torch.isnan(yd), torch.isnan(xd)), "NaN positions differ"
    inf = torch.isinf(xd)
    assert torch.equal(yd[inf], xd[inf]), "an Inf changed"
    finite = torch.isfinite(xd)
    assert torch.isfinite(yd[finite]).all(), "a finite value came back non-finite"
    err = (yd[finite] - xd[finite]).abs()
    assert err.numel() == 0 or err.max().item() <= e, f"max error {err.max().item()!r} > bound {e!r}"
    assert (yd[xd == 0] == 0).all(), "a zero did not come back exactly 0"


def relu_like(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randn(n, generator=g))


def smooth(n: int) -> torch.Tensor:
    t = torch.linspace(0.0, 20.0, n)
    return torch.sin(t) + 0.5 * torch.sin(3.7 * t)


def modes(p: Packed) -> torch.Tensor:
    return p.buffers["mode"].long()


# --- the bound, on the reference and the CPU kernel, byte for byte -------------------------

values = st.one_of(
    st.sampled_from([float(np.float32(v)) for v in SPECIALS]),  # as float32 holds them
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.floats(-4.0, 4.0, width=32),
)
bounds = st.one_of(
    st.floats(-8.0, 1.0).map(lambda k: 10.0**k),
    st.sampled_from([1e-8, 1e-3, 0.1, 1.0, 10.0, 5e-324, 1e-30, 2.0**-20]),
)


shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=hnp.arrays(np.float32, shapes, elements=values),
    dtype=st.sampled_from(DTYPES),
    e=bounds,
    group_size=st.sampled_from([8, 16, 64, 256]),
    strided=st.booleans(),
)
def test_bound_holds_and_implementations_agree(
    data: np.ndarray, dtype: torch.dtype, e: float, group_size: int, strided: bool
) -> None:
    base = torch.from_numpy(data).to(dtype)
    # A non-contiguous view with the same values: every other element of a wider tensor.
    x = torch.stack([base, torch.full_like(base, 7.0)], dim=-1)[..., 0] if strided else base
    codec = ErrorBoundCodec(group_size=group_size)
    ref = codec.encode(x, error_bound=e, impl="reference")
    cpu = codec.encode(x, error_bound=e, impl="cpu")
    assert ref.to_bytes() == cpu.to_bytes()
    assert ref.nbytes == sum(b.numel() * b.element_size() for b in ref.buffers.values())
    for impl in ("reference", "cpu"):
        assert_within_bound(x, codec.decode(cpu, impl=impl), e)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("values", "e"),
    [
        ([1.0, -1.5, 0.3, 0.0], 1e-30),  # bound far below every ulp: raw groups, exact
        ([3.0e38, -3.39e38, 1e38, 0.0], 1e30),  # huge values
        ([1e-45, 3e-45, -1e-40, 0.0], 1e-45),  # float32 denormals at a denormal bound
        ([1e-45, 3e-45, -1e-40, 0.0], 1e-42),
        ([6e-8, -6e-8, 1e-5, 0.0], 1e-8),  # float16 subnormals
        ([65504.0, -65504.0, 60000.0, 1.0], 100.0),  # float16 limits: the cast must not overflow
        ([2.5, 2.5, 2.5, 2.5], 1e-300),
        ([1.0, 2.0, 3.0, 4.0], 1e300),  # a bound larger than any float32
    ],
)
def test_extreme_values(dtype: torch.dtype, values: list[float], e: float) -> None:
    x = torch.tensor(values * 10, dtype=torch.float32).to(dtype)
    codec = ErrorBoundCodec(group_size=16)
    p = codec.encode(x, error_bound=e, impl="cpu")
    assert p.to_bytes() == codec.encode(x, error_bound=e, impl="reference").to_bytes()
    assert_within_bound(x, codec.decode(p), e)


@pytest.mark.parametrize("serial_below", [0, 1 << 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_serial_and_parallel_cpu_loops_write_the_same_record(
    monkeypatch: pytest.MonkeyPatch, serial_below: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.relu(torch.randn(5000, generator=gen) * 2.0).to(dtype)
    x[[7, 900]] = torch.tensor([math.inf, math.nan], dtype=dtype)
    codec = ErrorBoundCodec()
    ref = codec.encode(x, error_bound=1e-2, impl="reference")
    monkeypatch.setattr(_errorbound_kernels, "SERIAL_BELOW", serial_below)  # 0: parallel, 2**40: serial
    cpu = codec.encode(x, error_bound=1e-2, impl="cpu")
    assert cpu.to_bytes() == ref.to_bytes()
    bits = torch.int16 if dtype == torch.float16 else torch.int32
    decoded = codec.decode(cpu, impl="cpu").view(bits)
    assert torch.equal(decoded, codec.decode(ref, impl="reference").view(bits))


def test_small_tensors_take_the_serial_cpu_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_parallel(*args: object) -> None:
        raise AssertionError("a parallel launch for a small tensor")

    monkeypatch.setattr(_errorbound_kernels, "cpu_kernels", lambda: _errorbound_kernels.Kernels(
        no_parallel, no_parallel, no_parallel))
    codec = ErrorBoundCodec()
    x = torch.randn(3000)
    y = codec.decode(codec.encode(x, error_bound=1e-3, impl="cpu"), impl="cpu")
    assert float((y - x).abs().max()) <= 1e-3


def test_every_mode_appears_and_agrees() -> None:
    """One tensor whose groups are raw, sparse, dense and constant."""
    g = 64
    gen = torch.Generator().manual_seed(2)
    parts = [
        torch.randn(g, generator=gen),  # dense
        relu_like(g, seed=1),  # sparse
        torch.zeros(g),  # constant zero: no payload
        torch.full((g,), 0.25),  # constant: no payload
        torch.randn(g, generator=gen).index_fill(0, torch.tensor([3]), float("nan")),  # raw
        torch.randn(g // 2, generator=gen),  # a short last group
    ]
    x = torch.cat(parts)
    codec = ErrorBoundCodec(group_size=g)
    p = codec.encode(x, error_bound=1e-2)
    m = modes(p)
    assert m[0] & MODE_BITS > 0 and not m[0] & (MODE_SPARSE | MODE_RAW)
    assert m[1] & MODE_SPARSE
    assert m[2] == 0 and m[3] == 0
    assert m[4] == MODE_RAW
    sizes = torch.diff(p.buffers["offset"], append=torch.tensor([p.buffers["payload"].numel()]))
    assert sizes[2] == 0 and sizes[3] == 0 and sizes[4] == 4 * g
    assert p.to_bytes() == codec.encode(x, error_bound=1e-2, impl="reference").to_bytes()
    for impl in ("reference", "cpu"):
        assert_within_bound(x, codec.decode(p, impl=impl), 1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_raw_groups_keep_their_width(dtype: torch.dtype) -> None:
    """A bound below the dtype's resolution stores 16-bit values verbatim, not float32."""
    x = (torch.randn(1024) * 100).to(dtype)
    p = ErrorBoundCodec().encode(x, error_bound=1e-6)
    assert (modes(p) == MODE_RAW).all()
    assert p.buffers["payload"].numel() == 2 * x.numel()
    assert torch.equal(ErrorBoundCodec().decode(p), x)


# --- sizes --------------------------------------------------------------------------------


def test_relu_like_data_compresses() -> None:
    x = relu_like(1 << 16)
    assert (x == 0).float().mean() >= 0.5
    codec = ErrorBoundCodec()
    p = codec.encode(x, error_bound=1e-2)
    # Measured 5.9x (sparse groups of ~8-bit codes); 1M values give the same.
    assert p.ratio > 5.0
    assert (modes(p) & MODE_SPARSE).bool().all()
    assert_within_bound(x, codec.decode(p), 1e-2)


def test_smooth_data_compresses() -> None:
    x = smooth(1 << 16)
    p = ErrorBoundCodec().encode(x, error_bound=1e-3)
    assert p.ratio > 4.5  # measured 5.1x (10.1x at 1e-2)
    assert_within_bound(x, ErrorBoundCodec().decode(p), 1e-3)


@pytest.mark.parametrize("fill", [0.0, 0.7, -3.0])
def test_constant_tensor_costs_only_metadata(fill: float) -> None:
    x = torch.full((64, 1024), fill)
    p = ErrorBoundCodec().encode(x, error_bound=1e-3)
    groups = x.numel() // 256
    assert p.buffers["payload"].numel() == 0
    assert p.nbytes == groups * METADATA_BYTES
    assert p.ratio > 50.0
    y = ErrorBoundCodec().decode(p)
    assert_within_bound(x, y, 1e-3)
    if fill == 0.0:
        assert torch.equal(y, x)


def test_near_constant_tensor_is_small() -> None:
    e = 1e-3
    g = torch.Generator().manual_seed(3)
    x = 0.7 + (torch.rand(1 << 16, generator=g) - 0.5) * (e / 5)
    p = ErrorBoundCodec().encode(x, error_bound=e)
    assert (modes(p) & MODE_BITS).max() <= 1  # at most one grid boundary inside a group
    assert p.ratio > 20.0
    assert_within_bound(x, ErrorBoundCodec().decode(p), e)


def test_nbytes_is_the_sum_of_buffers_and_params_travel() -> None:
    x = relu_like(3000).reshape(30, 100)
    p = ErrorBoundCodec(group_size=128).encode(x, error_bound=0.05)
    assert p.nbytes == sum(b.numel() * b.element_size() for b in p.buffers.values())
    assert dict(p.params) == {"group_size": 128, "error_bound": 0.05}
    assert p.codec == "errorbound" and p.shape == (30, 100)
    # decode reads its configuration from the record, not from the codec instance
    assert_within_bound(x, ErrorBoundCodec(group_size=8).decode(p), 0.05)
    assert_within_bound(x, memctl.codecs.decode(p), 0.05)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (5, 7)])
def test_shapes_including_empty_and_scalar(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    for impl in ("reference", "cpu"):
        p = ErrorBoundCodec().encode(x, error_bound=1e-3, impl=impl)
        y = ErrorBoundCodec().decode(p, impl=impl)
        assert_within_bound(x, y, 1e-3)
    if x.numel() == 0:
        assert p.nbytes == 0


def test_registry_and_seed_is_ignored() -> None:
    x = torch.randn(4, 300, requires_grad=True)
    codec = memctl.codecs.get("errorbound", group_size=64)
    assert isinstance(codec, memctl.codecs.Codec)
    a = codec.encode(x, error_bound=1e-2, seed=1)
    b = codec.encode(x, error_bound=1e-2, seed=2)
    assert a.to_bytes() == b.to_bytes()
    assert_within_bound(x, memctl.codecs.decode(a), 1e-2)


# --- bits_for_range and errors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("r", "e", "bits"),
    [(0.0, 1e-3, 0), (2e-3, 1e-3, 1), (6.0, 1.0, 2), (14.0, 1.0, 3), (1.0, 1e-3, 9), (1.0, 0.5, 1)],
)
def test_bits_for_range(r: float, e: float, bits: int) -> None:
    assert bits_for_range(r, e) == bits
    assert bits_for_range(r, e) == math.ceil(math.log2(r / (2 * e) + 1))


def test_bits_for_range_matches_the_codec() -> None:
    """A group of range R on the grid never needs more bits than bits_for_range(R, e) + 1."""
    e = 1e-2
    x = torch.linspace(-1.0, 1.0, 256)
    p = ErrorBoundCodec().encode(x, error_bound=e)
    assert int(modes(p)[0] & MODE_BITS) <= bits_for_range(2.0, e) + 1


@pytest.mark.parametrize(("r", "e"), [(-1.0, 1e-3), (float("nan"), 1e-3), (1.0, 0.0), (1.0, float("inf"))])
def test_bits_for_range_rejects(r: float, e: float) -> None:
    with pytest.raises(ConfigError):
        bits_for_range(r, e)


@pytest.mark.parametrize("group_size", [0, -8, 12, 8.0, True, "256"])
def test_group_size_is_validated(group_size: object) -> None:
    with pytest.raises(ConfigError, match="group_size"):
        ErrorBoundCodec(group_size=group_size)  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    codec = ErrorBoundCodec(group_size=64)
    with pytest.raises(AttributeError):
        codec.group_size = 8  # type: ignore[misc]
    assert codec == ErrorBoundCodec(group_size=64)


@pytest.mark.parametrize("bound", [None, 0.0, -1e-3, float("nan"), float("inf"), True, "1e-3"])
def test_error_bound_is_validated(bound: object) -> None:
    with pytest.raises(ConfigError, match="error_bound"):
        ErrorBoundCodec().encode(torch.ones(4), error_bound=bound)  # type: ignore[arg-type]


def test_argument_errors_name_the_fix() -> None:
    codec = ErrorBoundCodec()
    with pytest.raises(ConfigError, match="quantize"):
        codec.encode(torch.ones(4), bits=2, error_bound=1e-3)
    with pytest.raises(CodecError, match="lossless"):
        codec.encode(torch.ones(4, dtype=torch.int64), error_bound=1e-3)
    with pytest.raises(CodecError, match="impl"):
        codec.encode(torch.ones(4), error_bound=1e-3, impl="tpu")
    p = codec.encode(torch.ones(4), error_bound=1e-3)
    with pytest.raises(CodecError, match="codec"):
        codec.decode(Packed("quantize", p.shape, p.dtype, p.device, p.buffers, p.params))
    broken = {k: v for k, v in p.buffers.items() if k != "offset"}
    with pytest.raises(CodecError, match="missing"):
        codec.decode(Packed("errorbound", p.shape, p.dtype, p.device, broken, p.params))


def test_cuda_compile_failure_falls_back_to_the_reference_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ CUDA fallback ]: a missing toolchain means reference bytes and one warning."""
    calls = []

    def no_toolchain() -> None:
        calls.append(1)
        raise ImportError("libNVVM cannot be found (nvvm missing)")

    codec = ErrorBoundCodec(group_size=16)
    x = relu_like(100)
    expected = codec.encode(x, error_bound=1e-2, impl="reference").to_bytes()
    monkeypatch.setattr(_errorbound_kernels, "cuda_kernels", no_toolchain)
    monkeypatch.setattr(_backend, "resolve_impl", lambda impl, device: memctl.codecs.Impl.CUDA)
    with pytest.warns(RuntimeWarning, match="cuda12"):
        p = codec.encode(x, error_bound=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = codec.decode(p)
    assert len(calls) == 1
    assert p.to_bytes() == expected
    assert_within_bound(x, y, 1e-2)


# --- CUDA simulator: the CUDA kernels on a few groups --------------------------------------


@pytest.mark.cudasim
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e", [1e-2, 1e-6])
def test_cuda_kernels_match_reference_in_simulator(dtype: torch.dtype, e: float) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(44, generator=g)
    x[::3] = 0.0  # a sparse group
    x[16:24] = 0.0
    x[32:40] = 1.5  # part of a short last group
    x[5], x[9] = float("nan"), float("-inf")  # a raw group
    x = x.to(dtype)
    codec = ErrorBoundCodec(group_size=8)
    ref = codec.encode(x, error_bound=e, impl="reference")
    sim = codec.encode(x, error_bound=e, impl="cuda")
    assert sim.to_bytes() == ref.to_bytes()
    y_ref = codec.decode(ref, impl="reference")
    y_sim = codec.decode(ref, impl="cuda")
    assert torch.equal(y_sim.isnan(), y_ref.isnan())
    assert torch.equal(y_sim.nan_to_num(), y_ref.nan_to_num())
    assert_within_bound(x, y_sim, e)


@pytest.mark.cudasim
def test_cuda_simulator_handles_sparse_ranks_and_constant_payloads() -> None:
    x = torch.tensor([0.0, 0.3, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0] + [0.0] * 12)
    codec = ErrorBoundCodec(group_size=24)
    p = codec.encode(x, error_bound=1e-3, impl="cuda")
    assert modes(p)[0] & MODE_SPARSE
    assert p.to_bytes() == codec.encode(x, error_bound=1e-3, impl="reference").to_bytes()
    assert_within_bound(x, codec.decode(p, impl="cuda"), 1e-3)
    zeros = codec.encode(torch.zeros(20), error_bound=1e-3, impl="cuda")
    assert zeros.buffers["payload"].numel() == 0
    assert torch.equal(codec.decode(zeros, impl="cuda"), torch.zeros(20))


# --- real GPU ------------------------------------------------------------------------------


def _gpu_codec_or_skip(codec: ErrorBoundCodec, x: torch.Tensor, e: float) -> Packed:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = codec.encode(x, error_bound=e)
    if any("could not be compiled" in str(w.message) for w in caught):
        pytest.skip(f"CUDA kernels cannot be compiled here: {_backend.CUDA_EXTRA_HINT}")
    return p


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_kernels_match_reference(dtype: torch.dtype) -> None:
    flat = torch.cat([relu_like(5000), torch.randn(3000), smooth(2000), torch.tensor(SPECIALS)])
    full = flat[: 7 * (flat.numel() // 7)].to(dtype).reshape(-1, 7)
    x = full[:, :5]  # non-contiguous
    x_gpu = full.cuda()[:, :5]
    codec = ErrorBoundCodec()
    for e in (1e-2, 1e-4):
        p = _gpu_codec_or_skip(codec, x_gpu, e)
        assert all(b.device == x_gpu.device for b in p.buffers.values())
        ref = codec.encode(x, error_bound=e, impl="reference")
        assert p.to_bytes() == ref.to_bytes()
        y = codec.decode(p)
        assert y.device == x_gpu.device
        assert_within_bound(x_gpu, y, e)
        y_ref = codec.decode(ref, impl="reference")
        assert torch.equal(y.cpu().isnan(), y_ref.isnan())
        assert torch.equal(y.cpu().nan_to_num(), y_ref.nan_to_num())


@pytest.mark.gpu
def test_gpu_reference_runs_on_the_device() -> None:
    x = relu_like(4096).cuda()
    codec = ErrorBoundCodec()
    p = codec.encode(x, error_bound=1e-3, impl="reference")
    assert all(b.device.type == "cuda" for b in p.buffers.values())
    assert p.to_bytes() == codec.encode(x.cpu(), error_bound=1e-3, impl="cpu").to_bytes()
    assert_within_bound(x, codec.decode(p, impl="reference"), 1e-3)
