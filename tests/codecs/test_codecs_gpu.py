"""Real-GPU tier: CUDA kernels on CUDA tensors against the reference on the CPU.

Every test here is marked ``gpu`` and skipped, with the reason, without a CUDA device.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from memctl import codecs
from memctl.codecs.lossless.codec import LosslessCodec
from memctl.codecs.quantize.codec import QuantizeCodec

pytestmark = pytest.mark.gpu

_CASES = [
    (1, 256, 1_000_003),
    (2, 256, 4_194_304),
    (2, 64, 77_777),
    (4, 128, 300_001),
    (8, 8, 12_345),
    (2, 256, 0),
    # the cases of test_quantize_cuda_teams.py (simulator) at full size
    (1, 8, 1_000_003),  # 32 groups per warp, a lane per group
    (2, 256, 16_777_221),  # the default: many turns of the grid-stride loop, a partial last group
    (2, 24, 999_999),  # a group of 3 lanes, two idle lanes per warp
    (2, 48, 1_000_000),  # 16 values a lane, a group of 3 lanes
    (1, 512, 2_000_005),  # one group per warp
    (4, 64, 1_500_001),
    (8, 256, 1_100_007),  # 8 bits, a whole warp per group
    (4, 1_024, 2_100_003),  # larger than a warp's tile: the block-per-group kernels
    (2, 256, 1),
]


def _data(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-30, 30, 7)[torch.arange(n) % 7]
    if n > 10:
        x[[3, n // 2, n - 1]] = torch.tensor([math.nan, math.inf, -math.inf])
        x[5] = -0.0
    return x


@pytest.mark.parametrize(("bits", "group", "numel"), _CASES)
def test_quantize_cuda_kernel_matches_cpu_reference(bits: int, group: int, numel: int) -> None:
    x = _data(numel, bits + numel)
    codec = QuantizeCodec(group_size=group)
    ref = codec.encode(x, bits=bits, seed=1234, impl="reference")
    gpu = codec.encode(x.cuda(), bits=bits, seed=1234)
    assert all(b.device.type == "cuda" for b in gpu.buffers.values())
    assert ref.to_bytes() == gpu.to_bytes()
    y_gpu = codec.decode(gpu)
    y_ref = codec.decode(ref, impl="reference")
    assert y_gpu.device.type == "cuda"
    assert torch.equal(y_gpu.cpu().nan_to_num(), y_ref.nan_to_num())
    assert torch.equal(y_gpu.cpu().isnan(), x.isnan())


_MASKED = [(2, 256, 4_194_311), (1, 8, 1_000_001), (4, 24, 777_777), (8, 256, 300_007), (2, 1_024, 300_001)]


@pytest.mark.parametrize(("bits", "group", "numel"), _MASKED)
def test_quantize_cuda_masked_decode_with_floor_matches_reference(bits: int, group: int, numel: int) -> None:
    from memctl.codecs.quantize import _kernels, _reference

    x = torch.relu(_data(numel, bits * group))
    payload, meta = _reference.encode(x, bits, group, 77)
    mask = LosslessCodec().encode(x > 0).buffers["payload"]
    floor = 1e-20
    expected = _reference.decode(payload, meta, bits, group, numel, mask, floor)
    out = _kernels.decode_cuda(payload.cuda(), meta.cuda(), bits, group, numel, mask.cuda(), floor)
    assert torch.equal(out.cpu().view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize(("bits", "group", "numel"), [(2, 256, 4_194_311), (1, 24, 100_003), (4, 1024, 3001)])
def test_quantize_cuda_encode_with_positive_matches_reference(bits: int, group: int, numel: int) -> None:
    x = torch.relu(_data(numel, group))
    codec = QuantizeCodec(group_size=group)
    record, mask = codec.encode_with_positive(x.cuda(), bits=bits, seed=5)
    assert mask.device.type == "cuda" and record.device.type == "cuda"
    assert record.to_bytes() == codec.encode(x, bits=bits, seed=5, impl="reference").to_bytes()
    assert mask.to_bytes() == LosslessCodec().encode(x > 0, impl="reference").to_bytes()


def test_quantize_cuda_encode_waits_for_nothing_and_lists_exceptions_later() -> None:
    """NOTE [ Exception lists without a wait ]: no encode of finite values synchronises with the
    GPU; then more records than are held for their check are encoded, and every record, with
    non-finite values or without, decodes as the reference's (listing exceptions does wait)."""
    from memctl.codecs.quantize import _pending

    codec = QuantizeCodec()
    xs = [_data(100_000 + i, i) for i in range(3 * _pending.MOST_WAITING)]
    clean = set(range(0, _pending.MOST_WAITING, 2))  # as many encodes as are held: none waits for room
    for i in clean:
        xs[i] = xs[i].nan_to_num(0.0, 0.0, 0.0)
    codec.encode(xs[0].cuda(), bits=2, seed=1)  # compiled before the check
    codec.encode_with_positive(torch.relu(xs[0]).cuda(), bits=2, seed=1)
    _pending.settle()
    inputs = [x.cuda() for x in xs]
    torch.cuda.synchronize()
    records: dict[int, Any] = {}
    positives: dict[int, Any] = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in sorted(clean):
            records[i] = codec.encode(inputs[i], bits=2, seed=i)
            positives[i] = codec.encode_with_positive(torch.relu(inputs[i]), bits=2, seed=i)[0]
        assert _pending.waiting() <= _pending.MOST_WAITING
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for i in range(len(xs)):
        if i not in clean:
            records[i] = codec.encode(inputs[i], bits=2, seed=i)
            positives[i] = codec.encode_with_positive(torch.relu(inputs[i]), bits=2, seed=i)[0]
    for i, x in enumerate(xs):
        assert records[i].to_bytes() == codec.encode(x, bits=2, seed=i, impl="reference").to_bytes()
        relu = torch.relu(x)
        assert positives[i].to_bytes() == codec.encode(relu, bits=2, seed=i, impl="reference").to_bytes()
        got = codec.decode(records[i]).cpu()
        assert torch.equal(got.isnan(), x.isnan()) and torch.equal(got.isinf(), x.isinf())
    _pending.settle()
    assert _pending.waiting() == 0


def test_quantize_cuda_small_tensor_launch_warns_nothing() -> None:
    """A small tensor gets a small grid on purpose: Numba's under-utilization warning stays silent."""
    from numba.core.errors import NumbaPerformanceWarning

    codec = QuantizeCodec()
    x = torch.randn(1000, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumbaPerformanceWarning)
        y = codec.decode(codec.encode(x, bits=2))
        codec.decode(QuantizeCodec(group_size=4096).encode(x, bits=4))
    assert y.shape == x.shape


def test_quantize_reference_on_gpu_matches_cpu_reference() -> None:
    x = _data(50_000, 5)
    codec = QuantizeCodec()
    cpu = codec.encode(x, bits=2, seed=9, impl="reference")
    gpu = codec.encode(x.cuda(), bits=2, seed=9, impl="reference")
    assert cpu.to_bytes() == gpu.to_bytes()
    assert torch.equal(codec.decode(gpu, impl="reference").cpu().nan_to_num(), codec.decode(cpu).nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_round_trip_on_cuda_keeps_device_shape_dtype(dtype: torch.dtype) -> None:
    x = torch.randn(33, 65, device="cuda", dtype=dtype).t()
    p = codecs.get("quantize").encode(x, bits=4)
    y = codecs.decode(p)
    assert y.device == x.device and y.dtype == dtype and y.shape == x.shape
    step = (x.float().max() - x.float().min()) / 15
    assert float((y.float() - x.float()).abs().max()) <= float(step) * 1.01 + 1e-2


@pytest.mark.parametrize("numel", [0, 1, 13, 1_000_001])
def test_lossless_cuda_kernel_matches_cpu_reference(numel: int) -> None:
    mask = torch.rand(numel) > 0.5
    codec = LosslessCodec()
    ref = codec.encode(mask, impl="reference")
    gpu = codec.encode(mask.cuda())
    assert ref.to_bytes() == gpu.to_bytes()
    y = codec.decode(gpu)
    assert y.device.type == "cuda" and torch.equal(y.cpu(), mask)
    x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(codecs.decode(codec.encode(x)), x)
