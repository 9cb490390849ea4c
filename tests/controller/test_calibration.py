"""The calibration's model of unmeasured layers (NOTE [ Unmeasured layers ]) and the default
policy's first step (NOTE [ Default policy ])."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import memctl
from memctl.controller.calibration import ONE_BIT_LEAST, Calibration, closed_form, law
from memctl.controller.config import ControllerConfig
from memctl.controller.stats import LayerState, grad_sq_names, median_grad_sq
from tests.controller.test_guard import NoisyNet, _steps


def _layer(name: str, range_term: float, grad_sq: float = 1.0) -> LayerState:
    return LayerState(name, ema_grad_sq=grad_sq, ema_range_term=range_term, numels=(4096,))


def test_fitted_width_factor_makes_the_uniform_total_match_the_measurement() -> None:
    cal = Calibration(ControllerConfig())
    a, b, c = _layer("a", 1.0), _layer("b", 3.0), _layer("c", 5.0)
    cal.record("a", 2, 0.5, closed_form(a, 1.0, 2), step=0)
    measured_at_2 = 40.0  # every layer at 2 bits at once
    cal.fit_width(2, measured_at_2, [a, b, c], 1.0)
    total = sum(cal.estimate(s, 1.0, 2) for s in (a, b, c))
    assert math.isclose(total, measured_at_2, rel_tol=1e-9)
    # the unmeasured layers share the rest in proportion to their closed forms
    assert math.isclose(cal.estimate(c, 1.0, 2) / cal.estimate(b, 1.0, 2), 5.0 / 3.0, rel_tol=1e-9)
    # a width fits on its own: 8 bits is not 2 bits moved by the (2^b - 1)^-2 law
    cal.fit_width(8, 2.0, [a, b, c], 1.0)
    ratio = cal.estimate(b, 1.0, 2) / cal.estimate(b, 1.0, 8)
    assert ratio < 0.5 * (255 / 3) ** 2
    # nothing unexplained: the unmeasured layers still get a quarter of the total, not zero
    cal2 = Calibration(ControllerConfig())
    cal2.record("a", 2, 100.0, closed_form(a, 1.0, 2), step=0)
    cal2.fit_width(2, 40.0, [a, b, c], 1.0)
    assert math.isclose(cal2.estimate(b, 1.0, 2) + cal2.estimate(c, 1.0, 2), 10.0, rel_tol=1e-9)


def test_a_one_bit_draw_below_two_bits_is_raised_to_four_times_two_bits() -> None:
    """NOTE [ One bit is never quieter than two ]: a layer measured quieter at 1 bit than at 2 (one
    low draw) must not look the quieter and smaller choice to the allocation."""
    a = _layer("a", 1.0)
    cal = Calibration(ControllerConfig())
    cal.record("a", 2, 1.25e-3, closed_form(a, 1.0, 2), step=0)
    cal.record("a", 1, 1.05e-3, closed_form(a, 1.0, 1), step=0)  # the LSTM's draws, in units
    two = cal.estimate(a, 1.0, 2)
    assert two == pytest.approx(1.25e-3)
    assert cal.estimate(a, 1.0, 1) == pytest.approx(ONE_BIT_LEAST * two)
    # a 1-bit draw above the floor stands as it was measured
    cal.record("a", 1, 20e-3, closed_form(a, 1.0, 1), step=0)
    assert cal.estimate(a, 1.0, 1) > ONE_BIT_LEAST * two


def test_an_eight_bit_measurement_predicts_eight_bits_only() -> None:
    """NOTE [ Eight-bit groups ]: 8 bits' groups are a quarter the size, so a layer whose quarters
    fall on structure adds far less at 8 bits than the law says; its 8-bit draw must not lower
    what the model predicts at 2 or 4 bits (on MobileOne's batch-norm inputs it would have)."""
    a, b = _layer("a", 1.0), _layer("b", 1.0)
    plain = Calibration(ControllerConfig())
    plain.record("b", 2, 0.5, closed_form(b, 1.0, 2), step=0)
    cal = Calibration(ControllerConfig())
    cal.record("b", 2, 0.5, closed_form(b, 1.0, 2), step=0)
    tiny = closed_form(a, 1.0, 8) * 1e-3  # a thousand times below the law at 8 bits
    cal.record("a", 8, tiny, closed_form(a, 1.0, 8), step=0)
    for bits in (1, 2, 4):
        assert cal.estimate(a, 1.0, bits) == pytest.approx(plain.estimate(a, 1.0, bits))
    assert cal.estimate(a, 1.0, 8) == pytest.approx(tiny)
    # the same for the widths fitted with every layer at once
    cal.fit_width(8, 1e-9, [a, b], 1.0)
    assert cal.estimate(a, 1.0, 2) == pytest.approx(plain.estimate(a, 1.0, 2))
    # and a 2-bit measurement still speaks for 8 bits, by the law at a quarter's groups
    assert cal.estimate(b, 1.0, 8) == pytest.approx(0.5 * law(2) / law(8), rel=0.05)


def test_width_factors_survive_state_dict() -> None:
    cal = Calibration(ControllerConfig())
    cal.fit_width(4, 3.0, [_layer("a", 1.0)], 1.0)
    again = Calibration(ControllerConfig())
    again.load_state_dict(cal.state_dict())
    assert again.width_factors == cal.width_factors and again.width_factors


def test_measurements_are_kept_relative_to_their_probes_gradient_scale() -> None:
    """NOTE [ Gradient scale ]: draws taken at gradient scales 10x apart are combined as ratios,
    and the estimate, the bound's reference and the report follow the probes' scale."""
    cal = Calibration(ControllerConfig())
    a = _layer("a", 1.0, grad_sq=1.0)
    p = closed_form(a, 1.0, 2)
    cal.record_reference(10.0, 5.0)
    cal.record("a", 2, 0.2, p, step=0)  # 2% of the probe's squared gradient norm
    assert math.isclose(cal.estimate(a, 1.0, 2), 0.2, rel_tol=1e-9)
    cal.record_reference(100.0, 50.0)  # the gradient grew 10x, the layer's value and closed form with it
    cal.record("a", 2, 2.0, 10 * p, step=10)
    scale = 0.5 * 10.0 + 0.5 * 100.0  # the probes' EMA
    assert cal.grad_sq == scale
    a.ema_grad_sq = scale / 10.0  # the closed form where the scale is: no drift of its own
    assert math.isclose(cal.estimate(a, 1.0, 2), 0.02 * scale, rel_tol=1e-9)
    assert math.isclose(cal.reference() or 0.0, 0.5 * scale, rel_tol=1e-9)
    assert math.isclose(cal.report(a, 1.0)["variance_measured"]["2"], 0.02 * scale, rel_tol=1e-9)
    # raw values would have been averaged as 0.2 and 2.0, whatever the scale today
    again = Calibration(ControllerConfig())
    again.load_state_dict(cal.state_dict())
    assert math.isclose(again.estimate(a, 1.0, 2), cal.estimate(a, 1.0, 2), rel_tol=1e-9)
    # a state saved before the scale existed held absolute values: its ‖g‖² EMA is their unit
    old = cal.state_dict()
    old.pop("relative")
    old["grad_sq"] = 20.0
    old["measured"] = {"a": {"2": [0.4, 2 * p, 10, 2, [0.4], [2 * p]]}}
    a.ema_grad_sq = 2.0
    old["grad_noise"] = 8.0
    legacy = Calibration(ControllerConfig())
    legacy.load_state_dict(old)
    assert math.isclose(legacy.estimate(a, 1.0, 2), 0.4, rel_tol=1e-9)
    assert math.isclose(legacy.reference() or 0.0, 8.0, rel_tol=1e-9)


def test_the_scale_follows_the_training_gradient_between_probes() -> None:
    """NOTE [ Gradient scale between probes ]: between probes the unit moves as the training
    gradient's squared norm does (less what the allocation in use adds to it), and the next
    probe is weighed against that, not against the scale of the probe before."""
    cal = Calibration(ControllerConfig())
    a, b = _layer("a", 1.0, grad_sq=1.0), _layer("b", 2.0, grad_sq=1.0)
    p = closed_form(a, 1.0, 2)
    cal.observe_training(4.0)  # the probe's own step boundary, read before the probe
    cal.record_reference(10.0, 5.0, median_grad_sq=1.0)
    cal.record("a", 2, 0.2, p, step=0)
    cal.fit_width(2, 1.0, [a, b], 1.0)  # b unmeasured: its closed form times a fitted factor
    b_then = cal.estimate(b, 1.0, 2)
    assert cal.unit() == 10.0
    for _ in range(20):
        cal.observe_training(0.04)  # the gradient's norm fell 10x
    assert math.isclose(cal.unit(), 0.1, rel_tol=1e-4)
    assert math.isclose(cal.estimate(a, 1.0, 2), 0.02 * cal.unit(), rel_tol=1e-4)
    # the closed forms' ‖∇Y‖² trail the fall (NOTE [ Sparse gradient statistics ]): the unit sets
    # their level, not the median ‖∇Y‖², and a layer's share among the layers still counts
    assert math.isclose(cal.estimate(b, 1.0, 2), b_then * 0.01, rel_tol=1e-4)
    b.ema_grad_sq = 4.0
    assert math.isclose(cal.estimate(b, 2.0, 2), b_then * 0.01 * 2.0, rel_tol=1e-4)
    b.ema_grad_sq = 1.0
    assert math.isclose(cal.reference() or 0.0, 0.5 * cal.unit(), rel_tol=1e-4)
    # an allocation that adds as much as the gradient itself doubles ‖ĝ‖², not the scale
    cal.added_share = 1.0
    for _ in range(20):
        cal.observe_training(0.08)
    assert math.isclose(cal.unit(), 0.1, rel_tol=1e-4)
    again = Calibration(ControllerConfig())
    again.load_state_dict(cal.state_dict())
    assert math.isclose(again.unit(), cal.unit(), rel_tol=1e-9)
    cal.record_reference(0.3, 0.1)  # the next probe, against the scale moved to its step
    assert math.isclose(cal.grad_sq or 0.0, 0.5 * 0.1 + 0.5 * 0.3, rel_tol=1e-4)
    assert math.isclose(cal.unit(), cal.grad_sq or 0.0, rel_tol=1e-9)


def test_a_measured_layer_drifts_with_its_share_among_the_layers() -> None:
    """NOTE [ Gradient scale between probes ]: a measurement's drift compares the layer's closed
    form over the median ‖∇Y‖², then and now, so a closed form that trails the unit's fall
    (with every other layer's) leaves the measured value as it was, and a layer whose share
    grew is predicted higher (square-rooted, clipped at 2x)."""
    cal = Calibration(ControllerConfig())
    a = _layer("a", 1.0, grad_sq=1.0)
    cal.observe_training(4.0)
    cal.record_reference(10.0, 5.0, median_grad_sq=1.0)
    cal.record("a", 2, 0.2, closed_form(a, 1.0, 2), step=0)
    for _ in range(20):
        cal.observe_training(0.0004)  # the gradient's ‖g‖² fell 10⁴-fold
    a.ema_grad_sq = 0.1  # its closed form and the median trail it at 10x
    cal.record_reference(cal.unit(), 0.5 * cal.unit(), median_grad_sq=0.1)  # a probe that skips "a"
    # (measured against this last probe's unit and median, "a"'s closed form would have
    # drifted 10x up, clipped at 2: the prediction twice the measurement)
    assert math.isclose(cal.estimate(a, 0.1, 2), 0.02 * cal.unit(), rel_tol=1e-4)
    assert math.isclose(cal.estimate(a, 0.1, 4), cal.estimate(a, 0.1, 2) * law(2) / law(4), rel_tol=1e-4)
    a.ema_grad_sq = 0.4  # its share among the layers grew 4x
    assert math.isclose(cal.estimate(a, 0.1, 2), 2.0 * 0.02 * cal.unit(), rel_tol=1e-4)
    again = Calibration(ControllerConfig())
    again.load_state_dict(cal.state_dict())
    assert again.measured["a"][2].shares == cal.measured["a"][2].shares != ()


def test_the_median_is_taken_over_the_layers_of_the_last_probe() -> None:
    """NOTE [ The median's layers ]: layers inside blocks closed at the probe (no ‖∇Y‖² then)
    that open later, with tiny gradients, do not move the median the closed forms' level is read
    against; a layer with its own ‖∇Y‖² keeps its estimate, and the state keeps the layers."""
    cal = Calibration(ControllerConfig())
    path = [_layer(f"path{i}", 1.0, grad_sq=1e-3 * (i + 1)) for i in range(3)]
    own = _layer("norm", 2.0, grad_sq=5e-3)
    inside = [LayerState(f"inside{i}", ema_range_term=1.0, numels=(4096,)) for i in range(6)]
    layers = [*path, own, *inside]
    assert math.isclose(median_grad_sq(layers), 2.5e-3)
    cal.observe_training(4.0)
    cal.record_reference(10.0, 5.0, median_grad_sq(layers), grad_sq_names(layers))
    cal.fit_width(2, 1.0, layers, cal.median_grad_sq(layers))
    before = cal.estimate(own, cal.median_grad_sq(layers), 2)
    for s in inside:  # the blocks open: gradients reach their layers, 10⁴ times smaller
        s.ema_grad_sq = 1e-7
    assert median_grad_sq(layers) == 1e-7  # over every layer now: the level would move 2·10⁴-fold
    assert math.isclose(cal.median_grad_sq(layers), 2.5e-3)
    assert math.isclose(cal.estimate(own, cal.median_grad_sq(layers), 2), before, rel_tol=1e-12)
    again = Calibration(ControllerConfig())
    again.load_state_dict(cal.state_dict())
    assert again.median_layers == cal.median_layers == {"path0", "path1", "path2", "norm"}
    # the next probe takes every layer with a ‖∇Y‖², and keeps them
    cal.record_reference(cal.unit(), 5.0, median_grad_sq(layers), grad_sq_names(layers))
    assert cal.median_grad_sq(layers) == 1e-7
    # a probe's layers that all lost their value: the median over every layer that has one
    cal.median_layers = frozenset({"gone"})
    assert cal.median_grad_sq(layers) == 1e-7


def test_predictions_follow_a_gradient_that_shrinks_after_the_last_probe() -> None:
    """A run whose gradient falls 100x in norm after its only probe (the loss scaled down):
    what the model predicts each layer adds falls with it (by ~10⁴, the drift's clip aside),
    where a scale held at the probe's would have stayed put."""
    torch.manual_seed(0)
    model = NoisyNet(12.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    # head_bits=None: every layer under the allocation's control, the head's input too
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, allocation_interval=1000,
                            calibration_fraction=1000.0, head_bits=None)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    y = (x @ torch.randn(32, 10, generator=g)).argmax(1)

    def predicted() -> dict[str, float]:
        layers = ctl.stats()["layers"]
        return {v["name"]: v["variance_predicted"]["2"] for v in layers
                if v.get("variance_predicted", {}).get("2")}

    for step in range(24):
        scale = 1.0 if step == 0 else 0.01
        (scale * nn.functional.cross_entropy(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            before = predicted()
            assert ctl._calibration.measured and before
    after = predicted()
    ctl.detach()
    for name, value in before.items():
        assert 1e-4 / 4 < after[name] / value < 1e-4 * 4, (name, after[name] / value)


def test_the_training_gradient_is_read_at_the_statistics_steps_and_every_eighth(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Gradient scale between probes ]: ‖ĝ‖² is read at the boundaries of the steps that
    gather the layers' statistics (the first two, the two before each re-solve) and never more
    than eight steps apart; the EMA decays per step across the steps not read."""
    from memctl.controller.controller import Controller

    read_at: list[int] = []
    original = Controller._training_grad_sq

    def counted(self: Controller) -> list[torch.Tensor]:
        read_at.append(self._step)
        return original(self)

    monkeypatch.setattr(Controller, "_training_grad_sq", counted)
    torch.manual_seed(0)
    model = NoisyNet(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, allocation_interval=10)
    x = torch.randn(64, 32)
    y = torch.randint(0, 10, (64,))
    for _ in range(30):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    ctl.detach()
    assert read_at == [0, 1, 9, 10, 18, 19, 20, 28, 29]
    cal = Calibration(ControllerConfig())
    cal.observe_training(1.0, 0)
    cal.observe_training(3.0, 8)  # eight steps on: the old value weighs 0.5 ** 8
    assert math.isclose(cal._train_sq or 0.0, 3.0 - 2.0 * 0.5**8, rel_tol=1e-12)


def test_probes_fit_every_width_while_layers_are_unmeasured() -> None:
    torch.manual_seed(0)
    model = NoisyNet(12.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, allocation_interval=2,
                            calibration_fraction=0.01, calibration_max_replays=1)
    _steps(ctl, 1)
    cal = ctl._calibration
    ctl.detach()
    assert sorted(cal.width_factors) == [2, 4, 8]
    assert all(f > 0 for f in cal.width_factors.values())


class _BitsSpy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize(("options", "first_bits"), [({}, 8.0), ({"bits": 2.0}, 2.0)])
def test_first_step_bits(options: dict[str, float], first_bits: float) -> None:
    """The default policy's first step, before anything was measured, runs at the most precise
    choice; ``bits=`` runs at what was asked for."""
    torch.manual_seed(0)
    model = _BitsSpy()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, calibration_fraction=0,
                            **options)  # type: ignore[arg-type]
    nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,))).backward()
    opt.step()
    used = {e["name"]: e["bits"] for e in ctl.stats()["layers"] if e["raw_bytes"] and e["name"] != "<root>"}
    ctl.detach()
    assert used and all(b == first_bits for b in used.values()), used


def test_guard_acts_at_the_first_probe() -> None:
    """Before any allocation the first steps ran at the configured bits: a layer that cannot take
    them is raised at the first probe, not one allocation interval later."""
    torch.manual_seed(0)
    model = NoisyNet(12.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, allocation_interval=50,
                            calibration_fraction=1000.0, bits=2, bit_choices=(2, 4, 8))
    _steps(ctl, 1)
    s = ctl.stats()
    ctl.detach()
    guard = [e for e in s["events"] if e["kind"] == "guard"]
    assert guard and guard[0]["step"] == 0, s["events"]
    assert "wiggle" in guard[0]["message"]


def test_a_probe_that_overspends_leaves_a_debt_the_next_steps_repay() -> None:
    """NOTE [ Probe cost ]: the share is kept over time, fixed replays included."""
    cal = Calibration(ControllerConfig(calibration_fraction=0.25))
    assert cal.affords(0.0)  # the first probe is always due
    cal.probes = 1
    cal.spend(train_s=10.0, spent_s=4.0)  # 2.5 s allowed, 4 s spent
    assert cal.carry_s == pytest.approx(-1.5)
    assert not cal.affords(5.0)
    assert cal.affords(6.0)
    # once every layer is measured, probes only follow drift: a fifth of the share
    cal.unmeasured([_layer("a", 1.0)])
    assert not cal.complete
    cal.record("a", 2, 0.5, 1.0, step=0)
    cal.unmeasured([_layer("a", 1.0)])
    assert cal.complete and cal.share() == pytest.approx(0.05)
    assert not cal.affords(6.0)
    assert cal.affords(30.0)


def test_a_probe_that_measures_the_last_layers_is_repaid_at_the_share_it_ran_under() -> None:
    """NOTE [ Probe cost ]: the first probe measures every layer at the full share and leaves none
    unmeasured; its debt is repaid in the training time that share sets, not five times as long
    at the fifth that follows (a text model of 300 steps probed three times, once at step 0)."""
    cal = Calibration(ControllerConfig(calibration_fraction=0.25))
    share = cal.share()
    assert share == pytest.approx(0.25)
    cal.probes = 1
    cal.record("a", 2, 0.5, 1.0, step=0)
    cal.unmeasured([_layer("a", 1.0)])  # the probe measured the last layer
    assert cal.share() == pytest.approx(0.05)
    cal.spend(train_s=10.0, spent_s=4.0, share=share)  # 2.5 s allowed at 0.25, 4 s spent
    assert not cal.affords(5.9)
    assert cal.affords(6.1)  # 1.5 s at 0.25: 6 s of training, as at the share it ran under


def _sparse_probes() -> memctl.Controller:
    """NoisyNet with a share of training time so small that only the first probe is paid for."""
    torch.manual_seed(0)
    model = NoisyNet(12.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, allocation_interval=2,
                             calibration_fraction=1e-6)


def test_a_probe_with_every_layer_measured_refreshes_as_many_as_its_fixed_replays() -> None:
    """NOTE [ Probe cost ]: once every layer is measured, a probe still measures as many pairs as
    the replays it cannot drop, so that at most half of it is overhead and a long run refreshes
    every layer (one pair a probe left some standing on step 0's draw to the end)."""
    ctl = _sparse_probes()
    _steps(ctl, 1)
    cal = ctl._calibration
    assert cal.probes == 1 and cal.complete
    cal.carry_s = 0.0  # the debt repaid: the next allocation step probes, its share affords no layer
    _steps(ctl, 2)
    ctl.detach()
    assert cal.probes == 2
    last = max(m.step for mine in cal.measured.values() for m in mine.values())
    fresh = [(n, b) for n, mine in cal.measured.items() for b, m in mine.items() if m.step == last]
    assert last > 0 and len(fresh) >= 4, fresh


def test_probes_wait_for_their_time_budget() -> None:
    """With a tiny share, a probe's debt is not repaid within the run: one probe, not one per
    allocation interval (before, every allocation step probed whatever the share)."""
    ctl = _sparse_probes()
    _steps(ctl, 12)
    probes = ctl.stats()["calibration"]["probes"]
    ctl.detach()
    assert probes == 1


def test_a_probe_with_layers_unmeasured_measures_as_many_as_its_fixed_replays() -> None:
    """NOTE [ Probe cost ]: the share decides how many layers a probe measures, but while a layer
    is unmeasured no fewer than the replays the probe cannot drop."""
    cal = Calibration(ControllerConfig(calibration_fraction=0.25, calibration_max_replays=16))
    cal.time_replay(1.0)
    cal.probes, cal.carry_s = 1, -5.0  # in debt: the share alone affords no layer
    assert cal.allowance(train_s=4.0, fixed_replays=3) == 1
    assert cal.allowance(train_s=4.0, fixed_replays=3, least=7) == 7
    assert cal.allowance(train_s=100.0, fixed_replays=3, least=7) == 16  # the share affords more
    capped = Calibration(ControllerConfig(calibration_max_replays=4))
    assert capped.allowance(train_s=0.0, fixed_replays=3, least=7) == 4


def test_the_first_probe_measures_every_layer_of_a_small_model() -> None:
    """With a share too small for more than one layer, the first probe still measures each of the
    model's layers with a record (once it measured one a probe, and the quarter share lasted four
    probes): three of its four, the first saving only the model's input, kept by reference (NOTE [
    Model inputs ])."""
    torch.manual_seed(0)
    model = NoisyNet(12.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, calibration_fraction=1e-6)
    _steps(ctl, 1)
    cal = ctl._calibration
    ctl.detach()
    assert cal.probes == 1 and cal.complete, (cal.probes, sorted(cal.measured))  # complete: every layer
    assert len(cal.measured) >= 3 and all(2 in mine for mine in cal.measured.values()), cal.measured


def test_doubtful_measurements_are_measured_again_first() -> None:
    """NOTE [ Doubtful measurements ]: a single measurement far below its width's other layers
    (a block measured while it was closed) and a layer whose share moved past the drift's clip
    since it was measured go ahead of the stalest pairs; the first few even ahead of layers
    not measured yet. Confirmed or unmoved, a measurement waits its turn again."""
    cal = Calibration(ControllerConfig(bit_choices=(1, 2, 4, 8)))
    cal.record_reference(1.0, 0.5, median_grad_sq=1.0)
    peers = [_layer(f"p{i}", 1.0) for i in range(6)]
    for i, s in enumerate(peers):
        cal.record(s.name, 2, closed_form(s, 1.0, 2), closed_form(s, 1.0, 2), step=i)
    closed = _layer("closed", 1.0)
    cal.record("closed", 2, 1e-6 * closed_form(closed, 1.0, 2), closed_form(closed, 1.0, 2), step=9)
    moved = _layer("moved", 1.0)
    cal.record("moved", 2, closed_form(moved, 1.0, 2), closed_form(moved, 1.0, 2), step=8)
    fresh = _layer("fresh", 1.0)
    layers = [*peers, closed, moved, fresh]
    # nothing doubtful yet but the closed block: it comes first, then the unmeasured pairs
    first = cal.schedule(layers, 100, 1.0, doubts_first=2)
    assert first[0] == ("closed", 2) and first[1] == ("fresh", 2)
    moved.ema_grad_sq = 10.0  # its share among the layers grew 10x: past the clip of 2x on √
    first = cal.schedule(layers, 100, 1.0, doubts_first=2)
    assert first[:3] == [("closed", 2), ("moved", 2), ("fresh", 2)]
    moved.ema_grad_sq = 3.0  # within the clip: the drift follows it, no need to measure again
    assert ("moved", 2) not in cal.doubtful(layers, 1.0)
    # measured again: the window holds two draws, and the stalest pairs come in step order
    cal.record("closed", 2, closed_form(closed, 1.0, 2), closed_form(closed, 1.0, 2), step=10)
    assert cal.doubtful(layers, 1.0) == []
    stale = [p for p in cal.schedule(layers, 100, 1.0) if p[1] == 2 and p[0] != "fresh"]
    assert stale[:2] == [("p0", 2), ("p1", 2)] and stale[-1] == ("closed", 2)
    # a measured value of zero against a closed form above it is the most doubtful of all
    zero = _layer("zero", 1.0)
    cal.record("zero", 2, 0.0, closed_form(zero, 1.0, 2), step=11)
    assert cal.doubtful([*layers, zero], 1.0)[0] == ("zero", 2)


def test_two_probes_far_above_a_layers_window_start_it_again() -> None:
    """NOTE [ Doubtful measurements ]: a block that opens during training (a zero-initialised
    batch norm's scale, a layer scale of 1e-6) adds more at every probe; its window's early
    draws describe another model, and two probes in a row far above them replace them. One
    probe alone is an outlier and is outvoted (NOTE [ Robust measurements ])."""
    cal = Calibration(ControllerConfig())
    a = _layer("a", 1.0)
    p = closed_form(a, 1.0, 2)
    for step, value in enumerate([1e-9, 1e-9, 1e-3]):
        cal.record("a", 2, value, p, step)
    assert cal.measured["a"][2].draws == (1e-9, 1e-9, 1e-3)
    cal.record("a", 2, 3e-3, p, 3)
    assert cal.measured["a"][2].draws == (1e-3, 3e-3)
    assert math.isclose(cal.estimate(a, 1.0, 2), 2e-3, rel_tol=1e-9)


def test_unmeasured_layers_are_measured_by_size_and_by_loudness_in_turn() -> None:
    """NOTE [ Which layers first ]: the largest layer, then the loudest guess, then the next
    largest, and so on, each once."""
    cal = Calibration(ControllerConfig(bit_choices=(2, 4, 8)))
    big = [LayerState(f"big{i}", ema_grad_sq=1.0, ema_range_term=1.0, numels=(10_000 - i,)) for i in range(3)]
    loud = [LayerState(f"loud{i}", ema_grad_sq=1e3 * (3 - i), ema_range_term=1.0, numels=(100,))
            for i in range(3)]
    order = [n for n, b in cal.schedule([*loud, *big], 100, 1.0) if b == 2]
    assert order == ["big0", "loud0", "big1", "loud1", "big2", "loud2"]
    # without the gradient statistics' median, by size alone
    assert [n for n, b in cal.schedule([*loud, *big], 100) if b == 2][:3] == ["big0", "big1", "big2"]


def test_a_closed_form_that_grew_against_the_unit_makes_its_measurement_doubtful() -> None:
    """NOTE [ Doubtful measurements ]: blocks that open together (ConvNeXt's layer scales) move
    no layer's share among the layers, but every closed form grows against the gradient's
    scale, and so does what the layers add: beyond 16x, measure again."""
    cal = Calibration(ControllerConfig())
    cal.record_reference(1.0, 0.5, median_grad_sq=1.0)
    a, b = _layer("a", 1.0), _layer("b", 1.0)
    for s in (a, b):
        cal.record(s.name, 2, closed_form(s, 1.0, 2), closed_form(s, 1.0, 2), step=0)
    assert cal.doubtful([a, b], 1.0) == []
    a.ema_grad_sq = b.ema_grad_sq = 10.0  # both grew 10x, as did the median: shares as they were
    assert cal.doubtful([a, b], 10.0) == []  # 10x against the unit: within 16x
    a.ema_grad_sq = b.ema_grad_sq = 100.0
    assert sorted(cal.doubtful([a, b], 100.0)) == [("a", 2), ("b", 2)]


def test_a_layer_stored_at_twice_its_bits_is_predicted_at_the_width_stored() -> None:
    """NOTE [ Widths a record is stored at ]: a replay that stores a layer's record at twice its
    bits measured the wider width; the law between widths follows the widths stored."""
    a = _layer("a", 1.0)
    cal = Calibration(ControllerConfig())
    cal.note_width("a", 2, True)  # the replay at 2 bits stored the record at 4
    assert cal.stored_bits("a", 1) == 2 and cal.stored_bits("a", 2) == 4
    assert cal.stored_bits("a", 4) == 8 and cal.stored_bits("a", 8) == 8
    cal.record("a", 2, 0.5, cal.closed_form(a, 1.0, 2), step=0)
    assert cal.estimate(a, 1.0, 2) == pytest.approx(0.5)
    assert cal.estimate(a, 1.0, 4) == pytest.approx(0.5 * law(4) / law(8))
    assert cal.estimate(a, 1.0, 8) == pytest.approx(cal.estimate(a, 1.0, 4))
    # 1 bit is stored at 2: the law from 4 to 2 bits, no 1-bit excess (no 1-bit record is made)
    assert cal.estimate(a, 1.0, 1) == pytest.approx(0.5 * law(4) / law(2))
    # a layer stored at its own bits keeps the law between its own widths
    plain = Calibration(ControllerConfig())
    plain.record("a", 2, 0.5, closed_form(a, 1.0, 2), step=0)
    assert plain.estimate(a, 1.0, 4) == pytest.approx(0.5 * law(2) / law(4))
    # its 1 and 2 bits (2- and 4-bit records) say nothing of what 1-bit records add over the law
    cal.record("a", 1, 0.5 * law(4) / law(2), cal.closed_form(a, 1.0, 1), step=0)
    assert cal.one_bit_excess() == 8.0  # the default, as with no layer measured at both
    # an 8-bit replay says nothing (no record is raised beyond 8), one at 2 bits unraised does
    cal.note_width("a", 8, False)
    assert "a" in cal.raised
    again = Calibration(ControllerConfig())
    again.load_state_dict(cal.state_dict())
    assert again.raised == {"a"}
    cal.note_width("a", 2, False)
    assert cal.stored_bits("a", 4) == 4


class _GeluMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_probes_find_the_layers_a_replay_stores_wider() -> None:
    """A GELU's input, replayed alone (the next layer's record exact), is stored at twice its bits
    (NOTE [ Outputs recomputed from the input ]): the probes note it, and the model predicts 4
    and 8 bits alike, as the replays measure them."""
    torch.manual_seed(0)
    model = _GeluMlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctl = memctl.Controller(model, opt, bits=2.0, monitor_interval_s=0, min_numel=64,
                            calibration_fraction=1000.0, allocation_interval=2)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    for _ in range(6):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    cal = ctl._calibration
    states = {s.name: s for s in ctl._layers.values() if s.numels}
    g2 = median_grad_sq(list(states.values()))
    ctl.detach()
    assert cal.raised == {"act"}, (cal.raised, sorted(cal.measured))
    measured = cal.measured["act"]
    assert 4 in measured and 8 in measured, measured
    # the premise: at 4 and 8 bits the replays stored the same 8-bit record
    assert 0.5 < measured[4].value / measured[8].value < 2.0, measured
    assert cal.estimate(states["act"], g2, 4) == pytest.approx(cal.estimate(states["act"], g2, 8))
    # fc2's input is stored at its own bits: 4 bits below 2 by about the law
    fc2 = cal.estimate(states["fc2"], g2, 2) / cal.estimate(states["fc2"], g2, 4)
    assert 0.3 * law(4) / law(2) < fc2 < 3.0 * law(4) / law(2), fc2


def test_a_width_measured_long_after_the_others_speaks_for_them() -> None:
    """NOTE [ Stale widths give way ]: a 2-bit measurement from step 0 gives way to a 4-bit one
    from step 140 (moved by the law); within 50 steps of each other each keeps its own."""
    a = _layer("a", 1.0)
    cal = Calibration(ControllerConfig())
    cal.record("a", 2, 0.5, closed_form(a, 1.0, 2), step=0)
    cal.record("a", 4, 0.2, closed_form(a, 1.0, 4), step=140)  # ten times the law's 4-bit value
    assert cal.estimate(a, 1.0, 2) == pytest.approx(0.2 * law(4) / law(2))
    assert cal.estimate(a, 1.0, 4) == pytest.approx(0.2, rel=1e-6)  # the pool leaves the old one out
    recent = Calibration(ControllerConfig())
    recent.record("a", 2, 0.5, closed_form(a, 1.0, 2), step=100)
    recent.record("a", 4, 0.2, closed_form(a, 1.0, 4), step=140)
    assert recent.estimate(a, 1.0, 2) == pytest.approx(0.5)
    # a 1-bit record does not follow the law: it never speaks for 2 bits
    one = Calibration(ControllerConfig())
    one.record("a", 2, 0.5, closed_form(a, 1.0, 2), step=0)
    one.record("a", 1, 40.0, closed_form(a, 1.0, 1), step=200)
    assert one.estimate(a, 1.0, 2) == pytest.approx(0.5)
    # a raised layer's 1 bit is a 2-bit record, which does
    one.note_width("a", 1, True)
    assert one.estimate(a, 1.0, 2) == pytest.approx(40.0 * law(2) / law(4), rel=1e-6)


def test_a_draw_long_after_the_window_starts_it_again() -> None:
    """NOTE [ Stale widths give way ]: a layer measured again more than 50 steps after its last
    draw stands on the new draw alone (the text model's GELU inputs grew 20x against ‖g‖² from
    step 0 to step 150); within 50 steps the draws share a window."""
    cal = Calibration(ControllerConfig())
    cal.record("a", 2, 0.01, 1.0, step=0)
    cal.record("a", 2, 0.03, 1.0, step=40)
    assert cal.measured["a"][2].draws == (0.01, 0.03) and cal.measured["a"][2].count == 2
    cal.record("a", 2, 0.2, 1.0, step=150)
    m = cal.measured["a"][2]
    assert m.draws == (0.2,) and m.value == pytest.approx(0.2) and m.count == 1 and m.step == 150


def test_pairs_gone_stale_are_refreshed_before_widths_never_measured_above_2_bits() -> None:
    """NOTE [ Stale widths give way ]: a long run's rare probes refresh what the allocation stands
    on before they fill in widths the law already covers; in a short run, whose probes come every
    few steps, the missing widths still come first."""
    cal = Calibration(ControllerConfig(bit_choices=(1, 2, 4, 8)))
    layers = [_layer("a", 1.0), _layer("b", 2.0)]
    for s in layers:
        cal.record(s.name, 2, 0.1, closed_form(s, 1.0, 2), step=0)
        cal.record(s.name, 1, 1.0, closed_form(s, 1.0, 1), step=30)
    soon = cal.schedule(layers, 100, 1.0, step=20)
    assert set(soon[:2]) == {("a", 4), ("b", 4)}, soon  # within 50 steps: the missing widths first
    assert soon.index(("a", 2)) > soon.index(("a", 8))
    later = cal.schedule(layers, 100, 1.0, step=70)
    assert set(later[:2]) == {("a", 2), ("b", 2)}, later  # more than 50 steps old: due first
    assert later.index(("a", 1)) > later.index(("a", 8))  # step 30 is not yet stale at 70
    assert len(later) == len(set(later))
