"""8-bit records in quarter groups (NOTE [ Eight-bit groups ] in the quantize codec): their bytes,
their error beside an outlier, and the range statistics they leave at the configured groups."""

from __future__ import annotations

import pytest
import torch

from memctl.codecs import get
from memctl.codecs.quantize.codec import group_at, packed_nbytes
from memctl.controller.batches import BatchRecord
from memctl.controller.config import ControllerConfig
from memctl.controller.hooks import ModuleTracker
from memctl.controller.packing import Packer


def test_group_at_is_a_quarter_of_the_group_at_eight_bits_only() -> None:
    assert [group_at(b, 256) for b in (1, 2, 4, 8)] == [256, 256, 256, 64]
    assert group_at(8, 192) == 48 and group_at(8, 224) == 56 and group_at(8, 32) == 8
    assert group_at(8, 240) == 240 and group_at(8, 8) == 8  # no quarter that is a multiple of 8


@pytest.mark.parametrize("numel", [1, 64, 1000, 4096])
def test_an_eight_bit_record_is_written_and_priced_in_quarter_groups(numel: int) -> None:
    codec = get("quantize", group_size=256)
    p = codec.encode(torch.randn(numel), bits=8, seed=3)
    assert p.params["group_size"] == 64 and p.buffers["meta"].shape == (-(-numel // 64), 2)
    assert p.nbytes == packed_nbytes(numel, 8, 256)


def test_an_outlier_sets_the_step_of_its_quarter_only() -> None:
    """One value of 1000 in each 256: the 255 values beside it had a step of ~4 (1000 / 255); in
    groups of 64 the 192 values in the other three quarters keep a step of their own range."""
    x = torch.randn(16, 256)
    x[:, 0] = 1000.0
    codec = get("quantize", group_size=256)
    errors = []
    for seed in range(4):
        y = codec.decode(codec.encode(x, bits=8, seed=seed)).reshape(16, 4, 64)
        errors.append((y - x.reshape(16, 4, 64))[:, 1:].abs().max())
    quarters = x.reshape(16, 4, 64)[:, 1:]  # the three quarters of each group without the outlier
    step = float(quarters.max() - quarters.min()) / 255
    assert max(float(e) for e in errors) <= step * (1 + 1e-5)
    assert step < 1000 / 255 / 50


def _eight_bit_packer() -> Packer:
    tracker = ModuleTracker()
    tracker.model_depth = 1

    def fail(layer: str, exc: BaseException) -> None:
        raise AssertionError(f"codec fallback in {layer}: {exc}")

    packer = Packer(ControllerConfig(min_numel=0), tracker, lambda layer: (8.0, None), fail, queue=False)
    packer.begin_step(0)
    return packer


def _term(ts: list[torch.Tensor]) -> float:
    groups = torch.cat([t.detach().reshape(-1, 256) for t in ts]).double()
    spans = groups.amax(dim=1) - groups.amin(dim=1)
    return float(spans.dot(spans)) * 256


@pytest.mark.parametrize("numel", [1 << 17, 1 << 10])  # a record of its own; a batch's records
def test_range_statistics_of_eight_bit_records_are_the_configured_groups(numel: int) -> None:
    """The layer's ``G·Σ R_g²`` over groups of 256, as at every other width: the 8-bit record's
    four quarters merged (their least min and largest max)."""
    packer = _eight_bit_packer()
    gen = torch.Generator().manual_seed(0)
    ts = [(torch.randn(numel, generator=gen) * (i + 1)).requires_grad_() for i in range(3)]
    for t in ts:
        t.data[::97] *= 30  # outliers: a quarter's range differs from its group's
    records = [packer.pack(t * 1) for t in ts]
    [rec] = packer.finish_step().values()
    assert all(int(r.data.params["group_size"]) == 64 for r in records)
    assert all(isinstance(r.data, BatchRecord) == (numel < 1 << 16) for r in records)
    assert float(sum(rec.range_terms)) == pytest.approx(_term(ts), rel=1e-9)
    assert float(min(rec.mins)) == float(min(t.detach().min() for t in ts))
    assert float(max(rec.maxs)) == float(max(t.detach().max() for t in ts))


def test_the_closed_forms_law_follows_the_codec_from_two_to_eight_bits() -> None:
    """The added variance the codec measures at 2 and 8 bits (mean squared error over seeds, on
    Gaussian values and on a ReLU's) against the law's ratio, 8 bits in quarter groups."""
    from memctl.controller.calibration import EIGHT_BIT_RANGES, law

    codec = get("quantize", group_size=256)
    gen = torch.Generator().manual_seed(0)
    for x in (torch.randn(1 << 16, generator=gen), torch.relu(torch.randn(1 << 16, generator=gen))):
        added = {b: sum(float((codec.decode(codec.encode(x, bits=b, seed=s)) - x).square().mean())
                        for s in range(4)) for b in (2, 8)}
        assert added[2] / added[8] == pytest.approx(law(8) / law(2), rel=0.15)
        # without the quarter groups the law was 0.69x off at 8 bits
        assert added[2] / added[8] > 1.25 * (255**2 / 3**2)
    assert law(4) == 225.0 and law(8) == pytest.approx(255**2 / EIGHT_BIT_RANGES)
