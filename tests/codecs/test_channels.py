"""The fused channel passes (NOTE [ Fused channel passes ] in memctl/codecs/channels.py) against PyTorch."""

from __future__ import annotations

import math

import pytest
import torch

from memctl import codecs
from memctl.codecs import channels
from memctl.codecs.base import mask_floor
from memctl.controller.regions import RELU, Interval, Partition

_INF = math.inf


def _reference(x: torch.Tensor, sub: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    shape = [1, -1] + [1] * (x.dim() - 2)
    return (x - sub.view(shape)) * scale.view(shape) + shift.view(shape)


def _values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    flat = x.view(-1)
    flat[:: 7] = 0.0  # exact zeros and values on the interval bounds below
    flat[3:: 11] = 1.0
    flat[5:: 13] = -1.0
    if flat.numel() > 20:
        flat[2], flat[9], flat[17] = float("nan"), float("inf"), float("-inf")
    return x


# (3, 5, 7, 3): blocks of 21 values, not whole mask bytes; (4, 8, 16, 16): the parallel launch
@pytest.mark.parametrize("shape", [(3, 5, 7, 3), (2, 4, 8), (1, 3), (4, 8, 16, 16), (16, 8, 32, 32)])
def test_affine_matches_pytorch(shape: tuple[int, ...]) -> None:
    x = _values(shape, 0)
    g = torch.Generator().manual_seed(1)
    c = shape[1]
    sub, shift = torch.randn(c, generator=g), torch.randn(c, generator=g)
    scale = torch.rand(c, generator=g) + 0.1
    got = channels.affine(x, sub, scale, shift)
    assert got is not None
    torch.testing.assert_close(got, _reference(x, sub, scale, shift), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(3, 5, 7, 3), (2, 4, 8), (4, 8, 16, 16), (16, 8, 32, 32)])
def test_masked_affine_is_relu_projection(shape: tuple[int, ...]) -> None:
    """With a ReLU result's mask, the pass equals Partition.project(relu(affine(x)), plane)."""
    x = _values(shape, 2)
    g = torch.Generator().manual_seed(3)
    c = shape[1]
    sub, scale, shift = torch.randn(c, generator=g), torch.randn(c, generator=g), torch.randn(c, generator=g)
    # the mask of other values than the affine map's (a decoded value on the wrong side of 0)
    plane = torch.rand(shape, generator=g) > 0.4
    bits = codecs.get("lossless").encode(plane).buffers["payload"]
    floor = mask_floor(torch.float32)
    want = RELU.project(torch.relu(_reference(x, sub, scale, shift)), plane)
    got = channels.affine(x, sub, scale, shift, mask=bits, floor=floor)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert not bool((got[~plane] != 0).logical_and(~got[~plane].isnan()).any())
    assert not bool(torch.signbit(got[~plane & ~got.isnan()]).any())  # +0, never -0


@pytest.mark.parametrize("interval", [
    Interval(0.0, _INF, True, False, 1),
    Interval(-_INF, 0.0, False, False, 1),
    Interval(-1.0, 1.0, True, True, 1),
    Interval(-1.0, 1.0, False, False, 1),
    Interval(0.5, _INF, False, False, 1),
])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 70_003])
def test_interval_bits_match_contains(interval: Interval, n: int) -> None:
    x = _values((n,), n)
    part = Partition("t", (interval,))
    got = part.packed_plane(x)
    assert got is not None
    want = codecs.get("lossless").encode(interval.contains(x)).buffers["payload"]
    assert torch.equal(got, want)


def test_interval_bits_of_a_non_contiguous_tensor_in_logical_order() -> None:
    x = _values((6, 10), 4).t()
    got = channels.interval_bits(x, 0.0, _INF, True, False)
    assert got is not None
    assert torch.equal(got, codecs.get("lossless").encode(x > 0).buffers["payload"])


def test_not_applicable_returns_none() -> None:
    x = torch.randn(2, 3, 4)
    v = torch.ones(3)
    assert channels.affine(x.double(), v.double(), v.double(), v.double()) is None
    assert channels.affine(x.transpose(1, 2), v, v, v) is None  # not contiguous
    assert channels.affine(x, torch.ones(4), v, v) is None  # not one value per channel
    assert channels.affine(x, v, v, v, mask=torch.zeros(2, dtype=torch.uint8)) is None  # mask too short
    assert channels.interval_bits(x.half(), 0.0, 1.0, True, True) is None
    assert channels.interval_bits(x, -_INF, _INF, False, False) is None
    two_bit = Partition("t", (Interval(-_INF, 0.0, False, True, 0), Interval(0.0, 1.0, False, True, 2),
                              Interval(1.0, _INF, False, False, 1)))
    assert two_bit.packed_plane(x) is None


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


# groups of 256 inside one channel block (16x16, 48x48), straddling blocks (7x3, 2x2), a
# partial last group, and the parallel launch (>= 65,536 values)
@pytest.mark.parametrize("shape", [(4, 8, 16, 16), (3, 5, 7, 3), (2, 64, 2, 2), (5, 3, 11), (8, 16, 48, 48)])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_decode_through_a_channel_map_is_the_decode_then_the_map(shape: tuple[int, ...], bits: int) -> None:
    """QuantizeCodec.decode_affine writes, bit for bit, channels.affine of the decoded tensor."""
    g = torch.Generator().manual_seed(bits)
    c = shape[1]
    scales = torch.rand(c, generator=g) * 5
    x = torch.randn(shape, generator=g) * scales.view(1, -1, *([1] * (len(shape) - 2)))
    q = codecs.get("quantize")
    p = q.encode(x, bits=bits, seed=7)
    sub, shift = torch.randn(c, generator=g), torch.randn(c, generator=g)
    scale = torch.rand(c, generator=g) + 0.5
    decoded = q.decode(p)
    got = q.decode_affine(p, sub, scale, shift)
    expected = channels.affine(decoded, sub, scale, shift)
    assert got is not None and expected is not None and _bitwise(got, expected)
    mask = codecs.get("lossless").encode(x > 0).buffers["payload"]
    got = q.decode_affine(p, sub, scale, shift, mask_bits=mask)
    expected = channels.affine(decoded, sub, scale, shift, mask=mask, floor=mask_floor(torch.float32))
    assert got is not None and expected is not None and _bitwise(got, expected)
    assert bool((got[x <= 0] == 0).all()) and bool((got[x > 0] > 0).all())


def test_decode_through_a_channel_map_declines_what_it_cannot_write() -> None:
    q = codecs.get("quantize")
    x = torch.randn(2, 4, 8, 8)
    ones = torch.ones(4)
    with_nan = x.clone()
    with_nan[0, 0, 0, 0] = float("nan")  # kept as an exception, put back after the kernel
    assert q.decode_affine(q.encode(with_nan, bits=2), ones, ones, ones) is None
    assert q.decode_affine(q.encode(x.half(), bits=2), ones, ones, ones) is None
    assert q.decode_affine(q.encode(x, bits=2), torch.ones(3), ones, ones) is None
    assert q.decode_affine(q.encode(x, bits=2), ones, ones.double(), ones) is None
    one = torch.ones(1)
    assert q.decode_affine(q.encode(x.reshape(-1), bits=2), one, one, one) is None  # no channel dimension
    wrong_mask = torch.zeros(3, dtype=torch.uint8)
    assert q.decode_affine(q.encode(x, bits=2), ones, ones, ones, mask_bits=wrong_mask) is None
