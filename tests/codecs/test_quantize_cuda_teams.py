"""The warp-team CUDA kernels of ``quantize`` (``memctl/codecs/quantize/_cuda_teams.py``) in the simulator.

Each case stays under ~3,000 values (the simulator is slow) and is compared byte for byte with
the PyTorch reference: encode (payload, metadata, exception list), decode, masked decode with a
floor, and the encode that also writes the ``x > 0`` mask. The grid is cut to one block of four
warps, so tensors of a few thousand values take several turns of the grid-stride loop.
The same cases at full size run on a real GPU in ``test_codecs_gpu.py``.
"""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from memctl.codecs import get
from memctl.codecs.quantize import _kernels as _quantize_kernels
from memctl.codecs.quantize import _reference as quantize_reference
from memctl.codecs.quantize.codec import QuantizeCodec

# (bits, group, numel): what each case covers
_CASES = [
    (1, 8, 2_597),  # 32 groups per warp, a lane per group; n not a multiple of 8
    (2, 256, 2_600),  # the default: 2 groups per warp tile, several loop turns, a partial last group
    (2, 24, 777),  # a group of 3 lanes (8 values each), two idle lanes per warp
    (2, 48, 1_000),  # 16 values a lane, a group of 3 lanes
    (1, 512, 1_500),  # the largest team: one group per warp
    (4, 64, 1_500),  # 8 lanes per group
    (8, 8, 1_001),  # 8 bits, a lane per group
    (8, 256, 1_100),  # 8 bits, a warp per group (through the codec 64: NOTE [ Eight-bit groups ])
    (8, 192, 700),  # a norm's row group at 8 bits: groups of 48 through the codec, 6 lanes of 8 values
    (4, 1_024, 2_100),  # larger than a warp's tile: the block-per-group kernels
    (4, 192, 700),  # a norm's row group (NOTE [ Norm rows in groups of their own ]): 24 lanes, 8 idle
    (2, 240, 600),  # a row of 960 in groups of 240: 15 lanes of 16 values
]


@pytest.fixture(autouse=True)
def _one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_quantize_kernels, "_team_grid", lambda *args: 1)


def _values(numel: int, seed: int) -> torch.Tensor:
    """ReLU-like values with NaN, ±Inf, -0.0, a constant group and an all-NaN first group."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * 4.0
    x = torch.where(x > 1.0, x, torch.zeros_like(x))
    x[[13, numel // 2, numel - 2]] = torch.tensor([math.inf, math.nan, -math.inf])
    x[numel // 3] = -0.0
    x[:8] = math.nan  # group 0 (or its first 8 values) without a finite value
    x[numel - 40 : numel - 24] = 2.5  # a run of equal values (a constant group when group <= 16)
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num().view(torch.int32), b.nan_to_num().view(torch.int32)
    )


@pytest.mark.cudasim
@pytest.mark.parametrize(("bits", "group", "numel"), _CASES)
def test_team_kernels_encode_and_decode_like_the_reference(bits: int, group: int, numel: int) -> None:
    x = _values(numel, seed=bits * 7 + group)
    codec = QuantizeCodec(group_size=group)
    ref = codec.encode(x, bits=bits, seed=2**32 - 5, impl="reference")
    sim = codec.encode(x, bits=bits, seed=2**32 - 5, impl="cuda")
    assert sim.to_bytes() == ref.to_bytes()
    assert sim.buffers["exc_index"].numel() == 11  # the 8 leading NaN, NaN and ±Inf
    assert _same(codec.decode(sim, impl="cuda"), codec.decode(ref, impl="reference"))


@pytest.mark.cudasim
@pytest.mark.parametrize(("bits", "group", "numel"), _CASES)
def test_masked_decode_with_a_floor_is_the_reference(bits: int, group: int, numel: int) -> None:
    x = _values(numel, seed=bits + group)
    payload, meta = quantize_reference.encode(x, bits, group, 11)
    mask = get("lossless").encode(x > 0).buffers["payload"]
    floor = 0.75  # above the lowest levels, so raised values occur
    out = _quantize_kernels.decode_cuda(payload, meta, bits, group, numel, mask, floor)
    expected = quantize_reference.decode(payload, meta, bits, group, numel, mask, floor)
    assert _same(out, expected)
    on = x.nan_to_num() > 0
    assert torch.all(out[on] >= floor) and torch.all(out[~on] == 0)


@pytest.mark.cudasim
@pytest.mark.parametrize(("bits", "group", "numel"), [_CASES[0], _CASES[1], _CASES[2], _CASES[-1]])
def test_cuda_encode_with_positive_writes_the_lossless_mask(bits: int, group: int, numel: int) -> None:
    x = _values(numel, seed=group)
    codec = QuantizeCodec(group_size=group)
    record, mask = codec.encode_with_positive(x, bits=bits, seed=4, impl="cuda")
    assert record.to_bytes() == codec.encode(x, bits=bits, seed=4, impl="reference").to_bytes()
    assert mask.to_bytes() == get("lossless").encode(x > 0).to_bytes()


def test_wrapping_hash_for_the_gpu_is_lowbias32() -> None:
    """The GPU's 32-bit ``lowbias32`` (products truncated, not masked) is the same function;
    compiled by Numba on the CPU, whose integer typing is the CUDA target's."""
    import numba
    import numpy as np

    from memctl.codecs import _rng
    from memctl.codecs.quantize import _cuda_teams

    mix = numba.njit(_cuda_teams._mix32_wrapping)
    rnd = random.Random(3)
    for x in [0, 1, 2**31, 2**32 - 1, 0x7FEB352D] + [rnd.getrandbits(32) for _ in range(2000)]:
        assert int(mix(np.uint32(x))) == _rng.lowbias32_int(x)


@pytest.mark.cudasim
def test_simulated_hash_and_key_above_two_to_the_32() -> None:
    """The simulator's hash and the per-2**32 key of NOTE [ Counter-based RNG ], for indices a
    test tensor cannot reach (``index >> 32`` up to 2**31)."""
    import numpy as np

    from memctl.codecs import _rng
    from memctl.codecs.quantize import _cuda_teams

    rnd = random.Random(4)
    for seed in (0, 1, 2**32 - 1, rnd.getrandbits(32)):
        for hi in (0, 1, 2, 3, 2**20 + 7, 2**31 - 1):
            assert int(_cuda_teams._key32(np.uint64(seed), np.int64(hi))) == _rng.key_int(seed, hi)
    for x in [0, 2**32 - 1] + [rnd.getrandbits(32) for _ in range(500)]:
        assert int(_cuda_teams._mix32(np.uint32(x))) == _rng.lowbias32_int(x)


def test_launch_silences_only_numbas_grid_size_warning() -> None:
    from numba.core.errors import NumbaPerformanceWarning

    class Kernel:
        def __init__(self, message: str) -> None:
            self.message = message

        def __getitem__(self, config: object) -> object:
            warnings.warn(NumbaPerformanceWarning(self.message), stacklevel=1)
            return config

    small = Kernel("Grid size 1 will likely result in GPU under-utilization due to low occupancy.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _quantize_kernels._configure(small, 1, 128, 0) == (1, 128, 0)
        with pytest.raises(NumbaPerformanceWarning, match="Host array"):
            _quantize_kernels._configure(Kernel("Host array used in CUDA kernel"), 1, 128, 0)


def test_team_kernels_cover_groups_up_to_one_warp_tile() -> None:
    from memctl.codecs.quantize import _cuda_teams

    assert [_cuda_teams.chunk_for(g, b) for g, b in [(256, 2), (24, 2), (256, 4), (512, 1)]] == [16, 8, 8, 16]
    assert _cuda_teams.uses_teams(512, 2) and not _cuda_teams.uses_teams(528, 2)
    assert _cuda_teams.uses_teams(256, 8) and not _cuda_teams.uses_teams(512, 8)
    assert _quantize_kernels._team_kernels(2, 256) is not None
    assert _quantize_kernels._team_kernels(4, 1_024) is None


def test_team_grid_covers_the_tiles_up_to_one_resident_wave(monkeypatch: pytest.MonkeyPatch) -> None:
    from memctl.codecs.quantize import _cuda_teams

    monkeypatch.undo()  # the real grid, not the fixture's single block
    monkeypatch.setattr(_quantize_kernels, "_multiprocessors", lambda device: 132)
    grid = _quantize_kernels._team_grid
    cpu = torch.device("cpu")
    assert grid(3, 256, 2, cpu) == 1  # 2 groups a warp: 2 tiles, one block of 4 warps
    assert grid(64, 8, 1, cpu) == 1  # 32 groups a warp
    assert grid(17, 256, 4, cpu) == 5  # 1 group a warp at 4 bits (8 values a lane)
    assert grid(10**7, 256, 2, cpu) == 132 * _cuda_teams.BLOCKS_PER_SM


@pytest.mark.cudasim
def test_tensor_of_one_value_and_of_one_partial_group() -> None:
    codec = QuantizeCodec(group_size=256)
    for x in (torch.tensor([3.0]), torch.linspace(-1.0, 1.0, 13)):
        ref = codec.encode(x, bits=2, seed=1, impl="reference")
        sim = codec.encode(x, bits=2, seed=1, impl="cuda")
        assert sim.to_bytes() == ref.to_bytes()
        assert _same(codec.decode(sim, impl="cuda"), codec.decode(ref, impl="reference"))
