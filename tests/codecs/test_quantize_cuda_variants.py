"""The variants of the team encode (``memctl/codecs/quantize/_cuda_variants.py``) in the simulator.

Each variant, at each width, encodes a few hundred values through the codec (payload,
metadata, exception list) and must write the PyTorch reference's record byte for byte and
decode to its values: whole and partial tiles, idle lanes, NaN and ±Inf inside otherwise full
lanes, a denormal, lanes past the end. One block of four warps (as in
``test_quantize_cuda_teams.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from memctl.codecs.quantize import _kernels as _quantize_kernels
from memctl.codecs.quantize.codec import QuantizeCodec

# (bits, group, numel): a warp tile is 32 * 16 values at 1 and 2 bits, 32 * 8 at 4 and 8 (groups of 16
# through the codec at 8 bits): each case has one whole tile (ADDR's unguarded loads) and a partial
# one; groups of 48 leave two lanes of each warp idle (its tiles take the guarded loads)
_CASES = [(1, 64, 540), (2, 32, 560), (2, 48, 150), (4, 16, 280), (8, 64, 270)]
# every Variant but BASE (named here: importing _cuda_variants at collection would import numba.cuda)
_VARIANTS = ["select", "fastpath", "sum32", "noprefetch", "wordstore", "addr", "lean"]


@pytest.fixture(autouse=True)
def _one_block(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_quantize_kernels, "_team_grid", lambda *args: 1)
    _quantize_kernels._team_kernels.cache_clear()
    yield
    _quantize_kernels._team_kernels.cache_clear()  # the next test builds today's kernels again


def _values(numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=gen) * 3.0
    x[[5, 40, numel - 3]] = torch.tensor([math.nan, math.inf, -math.inf])
    x[70:78] = -0.0  # a lane of zeros
    x[100] = 2.0**-140  # a denormal
    return x


@pytest.mark.cudasim
@pytest.mark.parametrize("name", _VARIANTS)
def test_variant_encodes_like_the_reference(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from memctl.codecs.quantize import _cuda_teams, _cuda_variants

    variant = _cuda_variants.Variant(name)
    def build(bits: int, chunk: int, simulated: bool) -> tuple[object, object]:
        return _cuda_variants.team_kernels(bits, chunk, simulated, variant)

    monkeypatch.setattr(_cuda_teams, "team_kernels", build)
    for bits, group, numel in _CASES:
        x = _values(numel)
        codec = QuantizeCodec(group_size=group)
        ref = codec.encode(x, bits=bits, seed=2**32 - 3, impl="reference")
        sim = codec.encode(x, bits=bits, seed=2**32 - 3, impl="cuda")
        assert sim.to_bytes() == ref.to_bytes(), (name, bits)
        assert sim.buffers["exc_index"].numel() == 3
        decoded = codec.decode(sim, impl="cuda").nan_to_num()
        assert torch.equal(decoded, codec.decode(ref, impl="reference").nan_to_num())


def test_every_variant_is_tested() -> None:
    from memctl.codecs.quantize import _cuda_variants

    others = [v.value for v in _cuda_variants.Variant if v is not _cuda_variants.Variant.BASE]
    assert sorted(_VARIANTS) == sorted(others)
