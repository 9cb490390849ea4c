"""NOTE [ Direct kernel launch ]: the parameter layout (here) and the launch itself (GPU tier)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from memctl.codecs import _launch


def test_array_parameters_follow_numbas_layout() -> None:
    types = importlib.import_module("numba.cuda.types")
    t = torch.zeros(3, 5, dtype=torch.float32)
    out: list[object] = []
    _launch._setter(types.Array(types.float32, 2, "C"))(t, out)
    # meminfo, parent, size, itemsize, data, shape..., strides in bytes...
    assert out == [0, 0, 15, 4, t.data_ptr(), 3, 5, 20, 4]


def test_scalar_parameters_take_their_numba_type() -> None:
    types = importlib.import_module("numba.cuda.types")
    out: list[object] = []
    for ty, value in [(types.int64, 7), (types.uint8, 200), (types.float32, np.float32(0.5)),
                      (types.float64, 2.0), (types.boolean, True)]:
        _launch._setter(ty)(value, out)
    assert [getattr(v, "value", v) for v in out] == [7, 200, 0.5, 2.0, True]
    assert [type(v).__name__ for v in out] == ["c_long", "c_ubyte", "c_float", "c_double", "bool"]


def test_unknown_parameter_types_are_refused() -> None:
    types = importlib.import_module("numba.cuda.types")
    with pytest.raises(TypeError, match="no direct layout"):
        _launch._setter(types.complex64)


def test_only_contiguous_cuda_tensors_and_scalars_take_the_direct_path() -> None:
    assert _launch._signature((1, 2.0, True, np.float32(1))) is not None
    assert _launch._signature((torch.zeros(4),)) is None  # a CPU tensor
    assert _launch._signature(("text",)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a real CUDA device")
def test_direct_launch_writes_what_the_usual_launch_writes() -> None:
    from memctl.codecs.lossless import _kernels

    gen = torch.Generator().manual_seed(0)
    for n in (1, 9, 4096, 1_000_003):
        mask = (torch.rand(n, generator=gen) > 0.5).cuda()
        first = _kernels.pack_cuda(mask)  # compiles, launched by Numba's dispatcher
        second = _kernels.pack_cuda(mask)  # launched directly
        assert torch.equal(first, second)
        assert torch.equal(_kernels.unpack_cuda(second, n), mask)
        assert torch.equal(_kernels.unpack_cuda(second, n), mask)
    assert not _kernels._direct("pack").broken and _kernels._direct("pack")._compiled
    assert not _kernels._direct("unpack").broken


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a real CUDA device")
@pytest.mark.parametrize("group", [256, 4096])  # warp teams, and the block-per-group kernels
def test_direct_quantize_launches_match_the_reference(group: int) -> None:
    import warnings

    from memctl.codecs.quantize.codec import QuantizeCodec

    codec = QuantizeCodec(group_size=group)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*direct kernel launch failed")
        for n in (100, 70_001, 3_000_000):  # the first compiles; the others launch directly
            x = torch.randn(n, generator=gen).relu_()
            ref = codec.encode(x, bits=2, seed=5, impl="reference")
            got = codec.encode(x.cuda(), bits=2, seed=5)
            assert got.to_bytes() == ref.to_bytes()
            mask = (x > 0).cuda()
            assert torch.equal(codec.decode(got, mask=mask).cpu(), codec.decode(ref, mask=x > 0))
