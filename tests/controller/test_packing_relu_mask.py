"""The ReLU-mask path of :class:`memctl.controller.packing.Packer` (NOTE [ ReLU masks ]).

The quantize codec applies the mask inside its decode (NOTE [ Masked decode ]); the unpacked
tensor must be exactly what decoding and then masking gives, and keep the ReLU's sign.
"""

from __future__ import annotations

import torch

from memctl.codecs import get
from memctl.codecs.base import Packed, mask_floor
from memctl.controller.config import ControllerConfig
from memctl.controller.packing import Packer, Saved
from memctl.controller.regions import RELU
from tests.controller.packers import strict_packer


def _packer() -> Packer:
    return strict_packer(ControllerConfig(min_numel=0))


def test_relu_output_unpacks_as_decode_then_mask() -> None:
    x = torch.randn(3000, 7, requires_grad=True)
    y = torch.relu(x)
    packer = _packer()
    saved = packer.pack(y)
    assert isinstance(saved, Saved)
    (code,) = saved.regions
    assert code.partition == RELU and len(code.planes) == 1
    out = packer.unpack(saved)
    decoded = get("quantize").decode(saved.data)
    positive = get("lossless").decode(code.planes[0])
    expected = decoded.clone().clamp_min_(mask_floor(torch.float32)).mul_(positive)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    # the fused decode is exactly the generic region projection of NOTE [ Derivative regions ]
    projected = RELU.project(decoded, positive.to(torch.uint8))
    assert torch.equal(out.view(torch.int32), projected.view(torch.int32))
    assert torch.equal(out > 0, y > 0)


def test_relu_gradient_through_the_packer_keeps_the_sign_mask() -> None:
    x = torch.randn(4096, requires_grad=True)
    packer = _packer()
    with torch.autograd.graph.saved_tensors_hooks(packer.pack, packer.unpack):
        y = torch.relu(x)
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, (x > 0).float())


class _NoMaskCodec:
    """The quantize codec, without ``decodes_mask``: the packer must apply the mask itself."""

    def __init__(self) -> None:
        self._inner = get("quantize")
        self.name = self._inner.name
        self.masks_passed = 0

    def encode(self, t: torch.Tensor, **options: object) -> Packed:
        return self._inner.encode(t, **options)  # type: ignore[arg-type]

    def decode(self, p: Packed, **options: object) -> torch.Tensor:
        self.masks_passed += "mask" in options
        return self._inner.decode(p, **options)  # type: ignore[arg-type]


def test_a_codec_without_masked_decode_gets_the_mask_applied_after() -> None:
    # NOTE [ Masks in decode ]: whether the mask goes into decode is the codec's declaration.
    y = torch.relu(torch.randn(2000, 5, requires_grad=True))
    fused = _packer()
    plain = _packer()
    codec = _NoMaskCodec()
    plain._codecs["quantize"] = codec  # type: ignore[assignment]
    a, b = fused.pack(y), plain.pack(y)
    assert isinstance(a, Saved) and isinstance(b, Saved)
    out_a, out_b = fused.unpack(a), plain.unpack(b)
    assert codec.masks_passed == 0
    assert torch.equal(out_a.view(torch.int32), out_b.view(torch.int32))
    assert torch.equal(out_b > 0, y > 0)
