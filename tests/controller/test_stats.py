"""Per-layer statistics (memctl/controller/stats.py): one read-back per step."""

from __future__ import annotations

import math

import pytest
import torch

import memctl
from memctl.controller import stats
from memctl.controller.stats import LayerState, LayerStep, read_scalars
from tests.controller.models import CNN


def _step(seed: int, n: int) -> LayerStep:
    g = torch.Generator().manual_seed(seed)
    step = LayerStep()
    for _ in range(n):
        t = torch.randn(5, generator=g)
        step.mins.append(t.min())
        step.maxs.append(t.max())
        step.range_terms.append((t.double() ** 2).sum())
        step.grad_sq.append(t.float().square().sum())
    return step


def test_read_scalars_matches_reading_each_list() -> None:
    steps = [_step(0, 3), _step(1, 1), LayerStep()]
    rows = read_scalars(steps)
    for step, (vmin, vmax, range_sum, g2) in zip(steps[:2], rows[:2], strict=True):
        assert vmin == float(torch.stack(step.mins).min())
        assert vmax == float(torch.stack(step.maxs).max())
        # sums in another order (on the host: math.fsum) agree to the last bits
        assert range_sum == pytest.approx(float(torch.stack(step.range_terms).sum()), rel=1e-12)
        assert g2 == pytest.approx(float(torch.stack([g.double() for g in step.grad_sq]).sum()), rel=1e-12)
    assert all(math.isnan(v) for v in rows[2])


def test_read_scalars_takes_floats_and_keeps_torchs_nan() -> None:
    """Values already on the host (floats) mix with tensors; a NaN anywhere is the answer, as
    torch's reductions give it, whatever its place."""
    step = _step(0, 3)
    expected = read_scalars([step])[0]
    step.mins[1] = float(step.mins[1])
    step.range_terms[0] = float(step.range_terms[0])
    assert read_scalars([step])[0] == pytest.approx(expected, rel=1e-12)
    for place in range(3):
        nan = _step(0, 3)
        nan.maxs[place] = float("nan")
        nan.range_terms[place] = torch.tensor(float("nan"), dtype=torch.float64)
        _, vmax, range_sum, _ = read_scalars([nan])[0]
        assert math.isnan(vmax) and math.isnan(range_sum)


def test_update_with_read_scalars_equals_update_alone() -> None:
    step = _step(3, 4)
    a, b = LayerState(name="a"), LayerState(name="b")
    a.update(step, batch=2, decay=0.9)
    b.update(step, batch=2, decay=0.9, scalars=read_scalars([step])[0])
    assert a == LayerState(**{**b.__dict__, "name": "a"})


def test_step_boundary_reads_back_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """NOTE [ One read-back per step ]: the controller folds every layer with one call."""
    calls: list[int] = []
    real = stats.read_scalars

    def counting(steps: list[LayerStep]) -> list[tuple[float, float, float, float]]:
        calls.append(len(steps))
        return real(steps)

    monkeypatch.setattr(memctl.controller.controller, "read_scalars", counting)
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0)
    try:
        for _ in range(2):
            model(torch.randn(4, 1, 16, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        ctl.detach()
    assert len(calls) == 2 and all(n > 1 for n in calls)
    assert sum(la["max"] is not None for la in ctl.stats()["layers"]) >= 5


def test_fold_for_a_device_read_turns_floats_into_tensors_on_the_values_device() -> None:
    """The device path (a GPU's values, read back once) takes floats beside tensors too."""
    folded = stats._fold([torch.tensor(1.5), 2.25, torch.tensor(-1.0, dtype=torch.float64)], torch.float64)
    assert folded.dtype == torch.float64 and folded.tolist() == [1.5, 2.25, -1.0]
