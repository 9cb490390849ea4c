"""``QuantizeCodec.decode(p, mask=...)``: the ReLU mask applied inside the decode kernel.

NOTE [ Masked decode ]: with a mask the result must equal, bit for bit (NaN as NaN), the unfused
``decode(p).clamp_min_(mask_floor(dtype)).mul_(mask)`` in every implementation (reference, CPU kernel,
serial and parallel, CUDA kernel in the simulator), for every dtype, with non-finite values.
"""

from __future__ import annotations

import math

import pytest
import torch

from memctl.codecs import get
from memctl.codecs.base import mask_floor
from memctl.codecs.quantize import _kernels as _quantize_kernels
from memctl.codecs.quantize.codec import QuantizeCodec
from memctl.errors import CodecError

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _relu_like(numel: int, dtype: torch.dtype, seed: int, specials: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * 3.0
    x = torch.where(x > 0.4, x, torch.zeros_like(x))
    x[::7] = 1e-7  # tiny positives, which 2-bit codes usually round to the group's zero
    if specials and numel > 20:
        x[[2, numel // 2, numel - 3]] = torch.tensor([math.inf, math.nan, -math.inf])
    return x.to(dtype)


def _unfused(codec: QuantizeCodec, p: object, positive: torch.Tensor, impl: str) -> torch.Tensor:
    out = codec.decode(p, impl=impl)  # type: ignore[arg-type]
    return out.clamp_min_(mask_floor(out.dtype)).mul_(positive.to(out.dtype))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that a NaN's sign and payload may differ (PyTorch's own ops vary there)."""
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    a, b = a.masked_fill(a.isnan(), 0.0), b.masked_fill(b.isnan(), 0.0)
    return torch.equal(a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("numel", "bits", "group"),
    [(1000, 2, 256), (300, 1, 64), (77, 4, 16), (130, 8, 8), (_quantize_kernels.SERIAL_BELOW + 520, 2, 256)],
)
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_masked_decode_is_decode_then_mask_bit_for_bit(
    dtype: torch.dtype, numel: int, bits: int, group: int, impl: str
) -> None:
    x = _relu_like(numel, dtype, seed=numel + bits, specials=True).reshape(-1, 1)
    codec = QuantizeCodec(group_size=group)
    p = codec.encode(x, bits=bits, seed=5)
    positive = x > 0
    mask = get("lossless").encode(positive)
    fused = codec.decode(p, impl=impl, mask=mask)
    assert _same_bits(fused, _unfused(codec, p, positive, impl))
    assert torch.equal(fused > 0, positive)  # every ReLU-positive value stays positive, the rest 0


def test_bool_tensor_mask_equals_record_mask() -> None:
    x = _relu_like(600, torch.float32, seed=1, specials=False)
    codec = QuantizeCodec()
    p = codec.encode(x, bits=2, seed=1)
    a = codec.decode(p, mask=x > 0)
    b = codec.decode(p, mask=get("lossless").encode(x > 0))
    assert _same_bits(a, b)


def test_mask_of_another_size_or_type_is_refused() -> None:
    codec = QuantizeCodec()
    p = codec.encode(torch.randn(64), bits=2)
    with pytest.raises(CodecError, match="mask has 65 values"):
        codec.decode(p, mask=torch.ones(65, dtype=torch.bool))
    with pytest.raises(CodecError, match="bool tensor"):
        codec.decode(p, mask=torch.ones(64))
    with pytest.raises(CodecError, match="lossless record of a bool"):
        codec.decode(p, mask=codec.encode(torch.randn(64)))


@pytest.mark.cudasim
@pytest.mark.parametrize(("bits", "group", "numel"), [(2, 64, 200), (1, 16, 90)])
def test_masked_cuda_decode_is_decode_then_mask_bit_for_bit(bits: int, group: int, numel: int) -> None:
    x = _relu_like(numel, torch.float32, seed=numel, specials=True)
    codec = QuantizeCodec(group_size=group)
    p = codec.encode(x, bits=bits, seed=2, impl="reference")
    positive = x > 0
    fused = codec.decode(p, impl="cuda", mask=get("lossless").encode(positive))
    assert _same_bits(fused, _unfused(codec, p, positive, "reference"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_masked_decode_writes_no_subnormal_value(dtype: torch.dtype, impl: str) -> None:
    # NOTE [ Mask floor ]: positives that 2 bits round to the group's zero come back at the
    # floor (2**-64, or float16's smallest normal), never as subnormals, whose products are slow.
    x = _relu_like(4096, dtype, seed=3, specials=False)
    codec = QuantizeCodec()
    out = codec.decode(codec.encode(x, bits=2, seed=2), impl=impl, mask=x > 0)
    floor = mask_floor(dtype)
    assert floor == (2.0**-14 if dtype is torch.float16 else 2.0**-64)
    raised = out[(x > 0) & (out.float() <= floor)]
    assert raised.numel() > 0 and torch.all(raised.float() == floor)
    nonzero = out[out != 0].float().abs()
    assert torch.all(nonzero >= torch.finfo(dtype).tiny)
