"""Robust calibration measurements (NOTE [ Robust measurements ]): outlying draws re-probed and
left out, absurd widths kept from the layer, the allocation in use's absurd draw reported."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import memctl
from memctl.controller import controller as controller_module
from memctl.controller.calibration import Calibration, closed_form
from memctl.controller.config import KEEP_BITS, ControllerConfig
from memctl.controller.outliers import absurd, robust_value, suspect
from memctl.controller.probe import ProbeResult, run_probe
from memctl.controller.replay import Capture
from memctl.controller.stats import LayerState
from tests.controller.test_guard import NoisyNet, _steps


def _layer(name: str) -> LayerState:
    return LayerState(name, ema_grad_sq=1.0, ema_range_term=1.0, numels=(4096,))


def test_robust_value_leaves_out_a_lone_outlier_and_keeps_a_reproduced_one() -> None:
    assert math.isclose(robust_value([1.0, 7.9e13, 3.0]), 2.0)
    assert math.isclose(robust_value([1.0, 2.0, 3.0]), 2.0)
    assert robust_value([7.9e13, 1.0, 6e13]) > 1e13  # two of three large: real, kept
    assert robust_value([1.0, math.nan, math.inf]) == math.inf
    assert math.isclose(robust_value([1.0, math.inf, 2.0]), 1.5)
    assert math.isclose(robust_value([2.0, 4.0]), 3.0)


def test_absurd_is_relative_to_the_gradient_scale() -> None:
    assert absurd(math.nan, 1.0) and absurd(math.inf, None) and absurd(-1.0, 1.0)
    assert absurd(2e4, 1.0) and not absurd(2e4, 10.0) and not absurd(2e4, None)
    assert suspect(9.0, 1e6, 1.0) and not suspect(7.0, 1e6, 1.0) and not suspect(9.0, 1e6, None)


def test_one_absurd_probe_does_not_move_a_layer_estimate() -> None:
    cal = Calibration(ControllerConfig())
    a = _layer("a")
    p = closed_form(a, 1.0, 2)
    for step, value in enumerate([1.0, 1.2, 0.8, 1e9, 1.0]):
        cal.record("a", 2, value, p, step)
    assert 0.5 < cal.estimate(a, 1.0, 2) < 2.0
    # a non-finite value is no measurement
    cal.record("a", 2, math.inf, p, 5)
    assert 0.5 < cal.estimate(a, 1.0, 2) < 2.0 and cal.measured["a"][2].count == 5
    again = Calibration(ControllerConfig())
    again.load_state_dict(cal.state_dict())
    assert again.measured == cal.measured


def test_an_unsafe_width_floors_the_layer_above_it() -> None:
    cal = Calibration(ControllerConfig())
    a = _layer("a")
    cal.record("a", 1, 1.0, closed_form(a, 1.0, 1), 0)
    assert cal.floor(a) is None
    cal.mark_unsafe("a", 2)
    assert cal.floor(a) == 4.0
    cal.mark_unsafe("a", 8)
    assert cal.floor(a) == float(KEEP_BITS)  # no width left: the highest choice (policy)
    again = Calibration(ControllerConfig())
    again.load_state_dict(cal.state_dict())
    assert again.unsafe == {"a": 8}


class _ScriptedReplayer:
    """Stands in for a Replayer: the exact gradient is 1, a replay compressing ``layer`` gives a
    gradient whose squared distance from it is taken from ``script`` in turn (then ``ordinary``)."""

    def __init__(self, layer: str, script: list[float], ordinary: float) -> None:
        self.layer, self.script, self.ordinary = layer, list(script), ordinary
        self.calls = 0
        self.raised: frozenset[str] = frozenset()  # no record stored wider than its layer's bits

    def gradient(self, model: Any, capture: Any, choice_for: Any, seed: int,
                 part: tuple[int, int] | None = None) -> torch.Tensor:
        if part is not None:  # the two half batches
            return torch.full((1,), float(part[0] + 1), dtype=torch.float64)
        if choice_for(self.layer)[0] >= KEEP_BITS:
            return torch.ones(1, dtype=torch.float64)
        self.calls += 1
        value = self.script.pop(0) if self.script else self.ordinary
        return torch.full((1,), 1.0 + math.sqrt(value), dtype=torch.float64)

    def begin_metric(self, model: Any) -> str:
        return "gradient"

    def end_metric(self) -> None:
        pass


def _probe(replayer: _ScriptedReplayer, cal: Calibration, in_use: Any, config: ControllerConfig,
           step: int = 0) -> Any:
    capture = Capture(args=(torch.zeros(4, 3),), kwargs={}, cpu_rng=torch.get_rng_state())
    capture.out_grads[0] = torch.zeros(1)
    return run_probe(torch.nn.Linear(1, 1), replayer, capture, cal, [_layer("a")], in_use,  # type: ignore[arg-type]
                     config, 1.0, step, train_s=0.0)


def _exact(name: str) -> tuple[float, float | None]:
    return float(KEEP_BITS), None


@pytest.mark.parametrize("first", [7.9e13, math.nan])
def test_an_absurd_layer_draw_is_reprobed_left_out_and_its_width_kept_from_the_layer(first: float) -> None:
    config = ControllerConfig(calibration_max_replays=1)
    cal = Calibration(config)
    replayer = _ScriptedReplayer("a", [first], ordinary=0.5)
    result = _probe(replayer, cal, _exact, config)
    assert result.measured and result.measured[0][:2] == ("a", 2)
    assert math.isclose(cal.measured["a"][2].value, 0.5, rel_tol=1e-6)
    assert result.redraws == 2 and result.unsafe == [("a", 2)]
    assert cal.floor(_layer("a")) == 4.0


def test_an_ordinary_draw_is_not_reprobed() -> None:
    config = ControllerConfig(calibration_max_replays=1)
    cal = Calibration(config)
    result = _probe(_ScriptedReplayer("a", [0.7], ordinary=0.5), cal, _exact, config)
    assert result.redraws == 0 and not result.unsafe
    assert math.isclose(cal.measured["a"][2].value, 0.7, rel_tol=1e-6)


def test_a_draw_far_above_the_layer_measurements_is_reprobed() -> None:
    config = ControllerConfig(calibration_max_replays=1)
    cal = Calibration(config)
    for bits in config.bit_choices:  # every width measured: the probe re-measures the stalest (1 bit)
        # 1 bit at four times 2 bits' (NOTE [ One bit is never quieter than two ]: no less is predicted)
        cal.record("a", bits, 2.0 if bits == 1 else 0.5, closed_form(_layer("a"), 1.0, bits), 0)
    # 20x the measured 2.0: suspect but not absurd (the gradient scale here is the noise, 1)
    result = _probe(_ScriptedReplayer("a", [40.0], ordinary=2.0), cal, _exact, config, step=10)
    assert result.measured[0][1] == 1
    assert result.redraws == 2 and not result.unsafe
    assert math.isclose(result.measured[0][2], 2.0, rel_tol=1e-6)


def test_an_absurd_draw_of_the_allocation_in_use_is_a_tail() -> None:
    config = ControllerConfig(calibration_max_replays=1)
    cal = Calibration(config)

    def in_use(name: str) -> tuple[float, float | None]:
        return 2.0, None

    replayer = _ScriptedReplayer("a", [7.9e13], ordinary=0.5)
    result = _probe(replayer, cal, in_use, config)
    assert result.tail and math.isclose(result.added, 0.5, rel_tol=1e-6)


def test_controller_reports_outliers_and_guard_acts_on_a_tail(monkeypatch: pytest.MonkeyPatch) -> None:

    real = controller_module.run_probe

    def tail_probe(*args: Any, **kw: Any) -> ProbeResult:
        out: ProbeResult = real(*args, **kw)
        out.added = 0.0  # the outlier-free value: no excess the noise guard would see
        out.tail, out.unsafe = True, [("fc2", 1)]
        return out

    monkeypatch.setattr(controller_module, "run_probe", tail_probe)
    torch.manual_seed(0)
    model = NoisyNet(4.0)
    ctl = memctl.Controller(model, torch.optim.SGD(model.parameters(), lr=0.05), monitor_interval_s=0,
                            min_numel=64, allocation_interval=2, calibration_fraction=1000.0, bits=2.0)
    _steps(ctl, 3)
    events = [e for e in ctl.stats()["events"] if e["kind"] in ("guard", "calibration_outlier")]
    ctl.detach()
    kinds = {e["kind"] for e in events}
    assert kinds == {"guard", "calibration_outlier"}, events
    assert any("absurd gradient" in e["message"] for e in events if e["kind"] == "guard")
