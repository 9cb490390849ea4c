"""``QuantizeCodec.encode_with_positive``: the record and the mask of ``t > 0`` in one pass.

NOTE [ Positive mask in encode ]: the pair must be, byte for byte, ``encode(t)`` and
``lossless.encode(t > 0)``, in every implementation, dtype and size (partial groups, partial
mask bytes, the parallel kernel), with zeros of both signs and non-finite values.
"""

from __future__ import annotations

import math

import pytest
import torch

from memctl.codecs import get
from memctl.codecs.quantize import _kernels as _quantize_kernels
from memctl.codecs.quantize.codec import QuantizeCodec
from memctl.errors import CodecError


def _values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    x[::5] = 0.0
    x[1::9] = -0.0
    x[2::13] = 1e-30  # tiny positives (0 in float16 and bfloat16 only after their own rounding)
    if numel > 20:
        x[[3, numel // 2, numel - 2]] = torch.tensor([math.inf, math.nan, -math.inf])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("numel", "bits", "group"),
    [(1, 2, 256), (13, 1, 8), (1000, 2, 256), (301, 4, 64), (130, 8, 16),
     (_quantize_kernels.SERIAL_BELOW + 517, 2, 256)],
)
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_encode_with_positive_is_encode_and_lossless_mask(
    dtype: torch.dtype, numel: int, bits: int, group: int, impl: str
) -> None:
    x = _values(numel, dtype, seed=numel + bits).reshape(1, -1)
    codec = QuantizeCodec(group_size=group)
    record, mask = codec.encode_with_positive(x, bits=bits, seed=11, impl=impl)
    expected = codec.encode(x, bits=bits, seed=11, impl=impl)
    expected_mask = get("lossless").encode(x > 0)
    assert record.to_bytes() == expected.to_bytes()
    assert dict(record.params) == dict(expected.params)
    assert (record.shape, record.dtype) == (expected.shape, expected.dtype)
    assert mask.to_bytes() == expected_mask.to_bytes()
    assert (mask.codec, mask.shape, mask.dtype, dict(mask.params)) == (
        expected_mask.codec, expected_mask.shape, expected_mask.dtype, dict(expected_mask.params))
    assert torch.equal(get("lossless").decode(mask), x > 0)


def test_encode_with_positive_feeds_the_masked_decode() -> None:
    x = torch.relu(_values(4099, torch.float32, seed=3)).nan_to_num(0.0, 0.0, 0.0)
    codec = QuantizeCodec()
    record, mask = codec.encode_with_positive(x, bits=2, seed=1)
    out = codec.decode(record, mask=mask)
    assert torch.equal(out > 0, x > 0)


def test_encode_with_positive_refuses_what_encode_refuses() -> None:
    codec = QuantizeCodec()
    with pytest.raises(CodecError, match="int64"):
        codec.encode_with_positive(torch.arange(10))
    with pytest.raises(CodecError, match="bits=3"):
        codec.encode_with_positive(torch.ones(10), bits=3)


@pytest.mark.cudasim
def test_cuda_encode_with_positive_is_encode_and_lossless_mask() -> None:
    x = _values(90, torch.float32, seed=4)
    codec = QuantizeCodec(group_size=16)
    record, mask = codec.encode_with_positive(x, bits=2, seed=3, impl="cuda")
    assert record.to_bytes() == codec.encode(x, bits=2, seed=3, impl="reference").to_bytes()
    assert mask.to_bytes() == get("lossless").encode(x > 0).to_bytes()
