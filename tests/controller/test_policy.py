"""The allocation's pricing of a layer's saved tensors (``memctl/controller/policy.py``)."""

from __future__ import annotations

from memctl.codecs.quantize.codec import packed_nbytes
from memctl.controller.config import KEEP_BITS
from memctl.controller.policy import _choice_bytes
from memctl.controller.stats import LayerState


def test_choice_bytes_prices_every_saved_tensor_when_sizes_repeat() -> None:
    # hundreds of equal sizes (a GRU layer) and a few odd ones: priced once per size, summed per tensor
    numels = (4096,) * 300 + (1000, 4096, 257, 1000)
    state = LayerState(name="gru", numels=numels, mask_bytes=12, element_size=4)
    for bits in (1, 2, 4, 8):
        expected = sum(packed_nbytes(n, bits, 256) for n in numels) + 12
        assert _choice_bytes(state, bits, 256) == expected
    assert _choice_bytes(state, KEEP_BITS, 256) == sum(numels) * 4
