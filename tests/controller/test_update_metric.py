"""Gradient noise measured in the optimizer's update metric (NOTE [ Update metric ])."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import memctl
from memctl.controller.calibration import Calibration
from memctl.controller.config import ControllerConfig
from memctl.controller.hooks import ModuleTracker
from memctl.controller.replay import Capture, Replayer, exact
from memctl.controller.update_metric import SCALE_FLOOR, UpdateMetric
from memctl.errors import ConfigError


def _stepped(opt_fn, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    opt = opt_fn(model.parameters())
    for _ in range(steps):
        x = torch.randn(8, 6)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _gains(metric: UpdateMetric, params: list[torch.Tensor]) -> list[float]:
    gains = metric.gains(params)
    assert gains is not None
    return [float(g) for g in gains]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam])
def test_adam_family_gain_is_the_bias_corrected_root_mean_second_moment(kind, amsgrad) -> None:
    if amsgrad and kind not in (torch.optim.Adam, torch.optim.AdamW):
        pytest.skip("AMSGrad is Adam's and AdamW's")
    options = {"amsgrad": True} if amsgrad else {}
    model, opt = _stepped(lambda ps: kind(ps, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, **options))
    params = list(model.parameters())
    got = _gains(UpdateMetric(opt), params)
    for p, gain in zip(params, got, strict=True):
        st = opt.state[p]
        v = st["max_exp_avg_sq"] if amsgrad else st["exp_avg_sq"]
        mean = float(v.mean()) / (1 - 0.99 ** float(st["step"]))
        assert gain == pytest.approx(1 / (math.sqrt(mean) + 1e-6), rel=1e-5)


def test_rmsprop_adagrad_and_adamax_gains() -> None:
    model, opt = _stepped(lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True, eps=1e-7))
    p = next(model.parameters())
    st = opt.state[p]
    mean = float(st["square_avg"].mean()) - float(st["grad_avg"].square().mean())
    assert _gains(UpdateMetric(opt), [p])[0] == pytest.approx(1 / (math.sqrt(mean) + 1e-7), rel=1e-5)

    model, opt = _stepped(lambda ps: torch.optim.Adagrad(ps, lr=1e-2))
    p = next(model.parameters())
    eps = opt.param_groups[0]["eps"]
    assert _gains(UpdateMetric(opt), [p])[0] == pytest.approx(
        1 / (math.sqrt(float(opt.state[p]["sum"].mean())) + eps), rel=1e-5)

    model, opt = _stepped(lambda ps: torch.optim.Adamax(ps, lr=1e-2))
    p = next(model.parameters())
    eps = opt.param_groups[0]["eps"]
    expected = 1 / (float(opt.state[p]["exp_inf"].mean()) + eps)
    assert _gains(UpdateMetric(opt), [p])[0] == pytest.approx(expected, rel=1e-5)


def test_linear_optimizers_and_no_optimizer_keep_the_gradient_metric() -> None:
    model, opt = _stepped(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))
    assert UpdateMetric(opt).gains(list(model.parameters())) is None
    assert UpdateMetric(opt).name == "gradient"
    assert UpdateMetric(None).gains(list(model.parameters())) is None
    model, opt = _stepped(lambda ps: torch.optim.Adam(ps, lr=1e-2))
    assert UpdateMetric(opt).name == "update"
    assert UpdateMetric(opt, enabled=False).gains(list(model.parameters())) is None
    fresh = torch.optim.Adam(nn.Linear(2, 2).parameters())  # no step yet: no state to read
    assert UpdateMetric(fresh).name == "gradient"


def test_parameters_the_optimizer_does_not_hold_weigh_nothing_and_those_without_state_the_mean() -> None:
    torch.manual_seed(0)
    a, b, c = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2)
    opt = torch.optim.Adam([*a.parameters(), *b.parameters(), *c.parameters()], lr=1e-2)
    b(a(torch.randn(3, 4))).sum().backward()  # c takes no gradient: Adam keeps no state for it
    opt.step()
    outside = nn.Parameter(torch.ones(3))
    params = [*a.parameters(), *b.parameters(), c.weight, outside]
    got = _gains(UpdateMetric(opt), params)
    with_state = [(g, p.numel()) for g, p in zip(got[:4], params[:4], strict=True)]
    mean = sum(g * n for g, n in with_state) / sum(n for _, n in with_state)
    assert got[4] == pytest.approx(mean, rel=1e-6)
    assert got[5] == 0.0


def test_a_tensor_whose_gradients_have_not_started_gains_at_most_the_floor_of_the_largest_scale() -> None:
    # a zero-initialised scale in front of a branch: neither the scale nor the branch behind it
    # takes a gradient at first, and Adam's v̂ of both is 0 (a gain of 1/ε without the floor)
    torch.manual_seed(0)
    trunk, branch = nn.Linear(4, 4), nn.Linear(4, 4)
    scale = nn.Parameter(torch.zeros(4))
    opt = torch.optim.Adam([*trunk.parameters(), *branch.parameters(), scale], lr=1e-2, eps=1e-8)
    x = torch.randn(16, 4)
    (trunk(x) + scale * branch(x)).square().mean().backward()
    opt.step()
    params = [*trunk.parameters(), *branch.parameters(), scale]
    assert float(opt.state[branch.weight]["exp_avg_sq"].abs().max()) == 0.0
    largest = max(math.sqrt(float(opt.state[p]["exp_avg_sq"].mean()) / (1 - 0.999)) for p in params)
    floor = 1 / (SCALE_FLOOR * largest + 1e-8)
    got = _gains(UpdateMetric(opt), params)
    assert got[2] == pytest.approx(floor, rel=1e-5) and got[3] == pytest.approx(floor, rel=1e-5)
    assert all(g <= floor * (1 + 1e-5) for g in got)
    # asked for the branch alone, its gain is still against the largest scale of all
    assert _gains(UpdateMetric(opt), [branch.weight])[0] == pytest.approx(floor, rel=1e-5)


def test_grad_sq_is_the_gains_squared_times_each_gradients_squared_norm() -> None:
    model, opt = _stepped(lambda ps: torch.optim.Adam(ps, lr=1e-2))
    params = list(model.parameters())
    grads = [torch.randn_like(p) for p in params]
    metric = UpdateMetric(opt)
    got = sum(float(x) for x in metric.grad_sq(list(zip(params, grads, strict=True))))
    expected = sum(gain ** 2 * float(g.square().sum()) for gain, g in zip(_gains(metric, params), grads,
                                                                           strict=True))
    assert got == pytest.approx(expected, rel=1e-5)
    plain = sum(float(g.square().sum()) for g in grads)  # the gradient's metric: no gains
    pairs = list(zip(params, grads, strict=True))
    for gradient_metric in (UpdateMetric(torch.optim.SGD(params, lr=1e-2)), UpdateMetric(opt, enabled=False)):
        assert sum(float(x) for x in gradient_metric.grad_sq(pairs)) == pytest.approx(plain, rel=1e-5)


def test_a_replay_between_begin_and_end_metric_is_each_parameters_gradient_times_its_gain() -> None:
    model, opt = _stepped(lambda ps: torch.optim.Adam(ps, lr=1e-2))
    config = ControllerConfig(min_numel=1, monitor_interval_s=0)
    tracker = ModuleTracker()
    handles = tracker.attach(model)
    try:
        x = torch.randn(8, 6)
        out = model(x)
        capture = Capture(args=(x,), kwargs={}, cpu_rng=torch.get_rng_state(),
                          out_grads={0: torch.autograd.grad(out.square().mean(), out)[0]})
        metric = UpdateMetric(opt)
        replayer = Replayer(config, tracker, torch.device("cpu"), metric=metric)
        plain = replayer.gradient(model, capture, exact, 0)
        assert replayer.begin_metric(model) == "update"
        scaled = replayer.gradient(model, capture, exact, 0)
        replayer.end_metric()
        again = replayer.gradient(model, capture, exact, 0)
    finally:
        for h in handles:
            h.remove()
    assert plain is not None and scaled is not None and again is not None
    gains = torch.cat([torch.full((p.numel(),), g) for p, g in zip(model.parameters(),
                                                                   _gains(metric, list(model.parameters())),
                                                                   strict=True)])
    torch.testing.assert_close(scaled, plain * gains)
    torch.testing.assert_close(again, plain)


def test_the_calibration_restarts_when_its_metric_changes() -> None:
    cal = Calibration(ControllerConfig())
    assert cal.use_metric("update") is None  # the first probe only names it
    cal.record_reference(2.0, 1.0, 1.0, None)
    cal.record("a", 2, 0.5, 0.1, step=0)
    assert cal.use_metric("update") is None and cal.measured
    cal.probes = 3
    assert cal.use_metric("gradient") == "update"
    assert not cal.measured and cal.grad_sq is None and cal.probes == 3 and cal.metric == "gradient"
    restored = Calibration(ControllerConfig())
    restored.load_state_dict(cal.state_dict())
    assert restored.metric == "gradient"
    old = Calibration(ControllerConfig())  # a state saved before the metric was kept
    state = {k: v for k, v in _measured_state().items() if k != "metric"}
    old.load_state_dict(state)
    assert old.metric == "gradient" and old.measured


def _measured_state() -> dict[str, object]:
    cal = Calibration(ControllerConfig())
    cal.use_metric("gradient")
    cal.record_reference(2.0, 1.0, 1.0, None)
    cal.record("a", 2, 0.5, 0.1, step=0)
    return cal.state_dict()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(32, 1, 16, 16, generator=g)
        y = torch.randint(0, 10, (32,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 16 * 16, 10))


def test_the_controller_measures_in_adams_update_metric_when_asked_and_sgds_gradient_metric() -> None:
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, variance_metric="update")
    _train(model, opt, 3)
    assert ctl.stats()["calibration"]["metric"] == "update"
    saved = ctl.state_dict()
    ctl.detach()
    assert saved["calibration"]["metric"] == "update"

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, variance_metric="update")
    _train(model, opt, 3)
    assert ctl.stats()["calibration"]["metric"] == "gradient"
    ctl.detach()

    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64)  # the default
    _train(model, opt, 3)
    assert ctl.stats()["calibration"]["metric"] == "gradient"
    ctl.detach()


def test_a_state_measured_in_the_gradient_metric_is_dropped_under_adam_with_an_event() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64)
    _train(model, opt, 3)
    saved = ctl.state_dict()
    ctl.detach()
    assert saved["calibration"]["metric"] == "gradient" and saved["calibration"]["measured"]

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, variance_metric="update")
    ctl.load_state_dict(saved)
    _train(model, opt, 12)  # past the next allocation step, whose probe measures
    stats = ctl.stats()
    ctl.detach()
    assert stats["calibration"]["metric"] == "update"
    events = [e for e in stats["events"] if e["kind"] == "calibration_metric"]
    assert len(events) == 1 and "gradient metric" in events[0]["message"], stats["events"]


def test_a_bad_variance_metric_names_the_value_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"variance_metric='adam'.*'update'.*'gradient'"):
        ControllerConfig(variance_metric="adam")
