"""The codec contract's declarations (``memctl/codecs/base.py``)."""

from __future__ import annotations

import torch

from memctl.codecs import get
from memctl.codecs.base import MASK_FLOOR, decodes_mask, mask_floor


def test_only_codecs_that_say_so_take_a_mask_in_decode() -> None:
    # NOTE [ Masks in decode ]: a class attribute, not the codec's name, decides.
    assert decodes_mask(get("quantize"))
    assert not decodes_mask(get("lossless"))

    class Plain:
        name = "quantize"  # the name alone does not make a codec apply masks

    class Truthy:
        decodes_mask = "yes"  # only True counts

    assert not decodes_mask(Plain())
    assert not decodes_mask(Truthy())


def test_mask_floor_is_normal_and_exact_in_each_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        floor = mask_floor(dtype)
        assert floor >= torch.finfo(dtype).tiny
        assert float(torch.tensor(floor, dtype=dtype)) == floor
    assert mask_floor(torch.float32) == MASK_FLOOR == 2.0**-64
    assert mask_floor(torch.float16) == torch.finfo(torch.float16).tiny
