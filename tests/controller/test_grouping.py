"""Several layers per replay (NOTE [ Several layers per replay ]): footprints found by a
layer's own measurement, groups of disjoint footprints, the premise checked at every replay."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import memctl
from memctl.controller import controller as controller_module
from memctl.controller.grouping import footprint, plan, sound
from memctl.controller.probe import ProbeResult
from tests.controller.test_guard import NoisyNet, _steps


def test_footprint_is_the_few_parameters_holding_the_error() -> None:
    assert footprint([0.0, 0.99, 0.01, 0.0]) == (1, 2)
    assert footprint([0.0, 0.999, 0.001, 0.0]) == (1,)
    assert footprint([5.0, 0.0, 0.0]) == (0,)
    assert footprint([1.0] * 10) == ()  # spread over every parameter
    assert footprint([0.0, 0.0]) == ()  # no error: nothing to attribute


def test_plan_groups_disjoint_footprints_of_one_width() -> None:
    prints = {"a": (0,), "b": (1,), "c": (0, 2), "d": ()}
    pairs = [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("a", 4), ("e", 1)]
    jobs = plan(pairs, prints, limit=3)
    assert jobs[0] == [("a", 1), ("b", 1)]  # c overlaps a
    assert [("c", 1)] in jobs and [("d", 1)] in jobs
    assert len(jobs) == 3  # the limit counts replays; ("a", 4) and ("e", 1) wait
    assert sum(len(j) for j in plan(pairs, prints, limit=10)) == len(pairs)


def test_sound_needs_the_error_inside_the_footprints() -> None:
    assert sound([1.0, 2.0, 0.001], [(0,), (1,)])
    assert not sound([1.0, 2.0, 0.5], [(0,), (1,)])
    assert not sound([math.nan, 2.0, 0.0], [(0,), (1,)])  # a non-finite draw cannot be told apart


def _probes(monkeypatch: pytest.MonkeyPatch) -> list[ProbeResult]:
    results: list[ProbeResult] = []
    real = controller_module.run_probe

    def spy(*args: Any, **kw: Any) -> ProbeResult:
        out = real(*args, **kw)
        results.append(out)
        return out

    monkeypatch.setattr(controller_module, "run_probe", spy)
    return results


def _controller(groups: bool | None = True, **kw: Any) -> memctl.Controller:
    """A controller on ``NoisyNet``; ``groups=None`` leaves ``calibration_groups`` at its default."""
    torch.manual_seed(0)
    model = NoisyNet(4.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if groups is not None:
        kw["calibration_groups"] = groups
    # fc1's saved input is the model's: compressed here, as the subject is a linear layer's input
    return memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, allocation_interval=2,
                             calibration_fraction=1000.0, calibration_max_replays=4, keep_inputs=False,
                             **kw)


def test_linear_inputs_are_measured_together_and_agree_with_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    results = _probes(monkeypatch)
    ctl = _controller()
    _steps(ctl, 9)
    cal = ctl._calibration
    ctl.detach()
    index = {name: i for i, (name, p) in enumerate(ctl.model.named_parameters())}
    # a linear layer's saved input reaches only its own parameters' gradients
    for name in ("fc1", "fc2"):
        assert index[f"{name}.weight"] in cal.footprints[name]
        assert set(cal.footprints[name]) <= {index[f"{name}.weight"], index[f"{name}.bias"]}
    assert sum(r.grouped for r in results) > 0
    # a probe measured more (layer, width) pairs than it ran layer replays
    assert any(len(r.measured) > 4 for r in results)
    # grouped and alone, one layer's draws agree (no other layer's error leaks in)
    draws = cal.measured["fc2"][2].draws
    assert len(draws) >= 2 and max(draws) < 3 * min(draws), draws


def test_a_wrong_footprint_is_caught_and_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    results = _probes(monkeypatch)
    ctl = _controller()
    _steps(ctl, 3)
    cal = ctl._calibration
    index = {name: i for i, (name, p) in enumerate(ctl.model.named_parameters())}
    # the wiggle's error reaches fc1's weight and bias, not fc2's weight
    cal.footprints["wiggle"] = (index["fc2.weight"],)
    _steps(ctl, 4, seed=1)
    ctl.detach()
    assert cal.footprints["wiggle"] != (index["fc2.weight"],)
    assert results


def test_linear_layers_are_grouped_from_the_first_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    results = _probes(monkeypatch)
    ctl = _controller()
    _steps(ctl, 1)
    ctl.detach()
    # fc1 and fc2 own their inputs: one replay measures both at the first width
    assert results and results[0].grouped >= 1
    assert {(n, b) for n, b, _ in results[0].measured} >= {("fc1", 2), ("fc2", 2)}


class _SharedInput(torch.nn.Module):
    """``a`` and ``b`` read the same input: ``a`` saves it first, ``b`` reuses ``a``'s record, so
    compressing layer ``a`` also moves ``b``'s weight gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(32, 64)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(x) + self.b(x)))


def test_a_prior_footprint_that_does_not_hold_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    results = _probes(monkeypatch)
    torch.manual_seed(0)
    model = _SharedInput()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, allocation_interval=2,
                            calibration_groups=True, keep_inputs=False,  # x: a's record, shared by b
                            calibration_fraction=1000.0, calibration_max_replays=4)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randn(64, 32, generator=g)
        torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (64,), generator=g)).backward()
        opt.step()
        opt.zero_grad()
    cal = ctl._calibration
    ctl.detach()
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    assert "b" not in cal.measured  # b holds no record of its own
    # the prior (a's own weight and bias) missed b's weight; measured alone, a's footprint has it
    assert index["b.weight"] in cal.footprints["a"], cal.footprints
    assert results


def test_grouping_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``calibration_groups=True`` every replay measures one layer."""
    results = _probes(monkeypatch)
    ctl = _controller(groups=None)
    _steps(ctl, 3)
    ctl.detach()
    assert results and sum(r.grouped for r in results) == 0
