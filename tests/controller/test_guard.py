"""The convergence guard (NOTE [ Convergence guard ])."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

import memctl
from memctl.controller.guard import ConvergenceGuard, LayerNoise


class Wiggle(nn.Module):
    """``x + 6 sin(f x) / f``: its backward reads ``cos(f x)`` of the saved input, so at a
    large ``f`` a coarse rounding of that input turns the gradient below it into noise."""

    def __init__(self, freq: float) -> None:
        super().__init__()
        self.freq = freq

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 6.0 * torch.sin(self.freq * x) / self.freq


class NoisyNet(nn.Module):
    def __init__(self, freq: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 256)
        self.wiggle = Wiggle(freq)
        self.fc2 = nn.Linear(256, 256)
        self.act = nn.ReLU()
        self.fc3 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act(self.fc2(self.wiggle(self.fc1(x)))))


def _train(freq: float, steps: int = 7, **kw: object) -> memctl.Controller:
    torch.manual_seed(0)
    model = NoisyNet(freq)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, allocation_interval=2,
                            calibration_fraction=1000.0, **kw)  # type: ignore[arg-type]
    _steps(ctl, steps)
    return ctl


def _steps(ctl: memctl.Controller, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=g)
    y = (x @ torch.randn(32, 10, generator=g)).argmax(1)
    g.manual_seed(seed + 1)
    opt = ctl.optimizer
    assert opt is not None
    for _ in range(steps):
        idx = torch.randint(0, 512, (64,), generator=g)
        nn.functional.cross_entropy(ctl.model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()


def test_guard_raises_bits_of_an_injected_noisy_layer(caplog: pytest.LogCaptureFixture) -> None:
    # bits=2 with no 1-bit choice pins every layer at 2 bits: the average leaves no room,
    # so only the guard can give the noisy layer more.
    with caplog.at_level(logging.WARNING, logger="memctl.controller"):
        ctl = _train(freq=12.0, bits=2, bit_choices=(2, 4, 8))
    s = ctl.stats()
    ctl.detach()
    guard = [e for e in s["events"] if e["kind"] == "guard"]
    assert guard, s["events"]
    assert "wiggle" in guard[0]["message"]
    layer = {e["name"]: e for e in s["layers"]}["wiggle"]
    assert layer["floor_bits"] is not None and layer["floor_bits"] >= 4
    assert layer["next_bits"] >= 4
    assert s["calibration"]["guard_actions"] >= 1
    assert any("convergence guard" in r.getMessage() for r in caplog.records)
    # the measured added variance of the noisy layer dwarfs the others' at 2 bits
    measured = {e["name"]: e["variance_measured"].get("2", 0.0)
                for e in s["layers"] if e.get("variance_measured")}
    assert max(measured, key=lambda n: measured[n]) == "wiggle", measured


def test_the_default_bound_raises_a_layer_that_adds_half_the_gradients_variance() -> None:
    """Uniform 2 bits with a moderately wiggly layer add about half the minibatch gradient's
    own variance at the first probe (what a batch a third smaller has): under the default
    ``guard_bound`` (0.3) the guard raises that layer; at the old bound of 1.0 it did not."""
    ctl = _train(freq=4.0, steps=3, bits=2, bit_choices=(2, 4, 8))
    s = ctl.stats()
    ctl.detach()
    guard = [e for e in s["events"] if e["kind"] == "guard"]
    assert guard and "wiggle" in guard[0]["message"], s["events"]
    assert {e["name"]: e for e in s["layers"]}["wiggle"]["next_bits"] >= 4
    loose = _train(freq=4.0, steps=3, bits=2, bit_choices=(2, 4, 8), guard_bound=1.0)
    s = loose.stats()
    loose.detach()
    assert not [e for e in s["events"] if e["kind"] == "guard"], s["events"]


def test_guard_stays_quiet_on_a_smooth_layer() -> None:
    ctl = _train(freq=1.0, bits=2, bit_choices=(2, 4, 8))
    s = ctl.stats()
    ctl.detach()
    assert not [e for e in s["events"] if e["kind"] == "guard"], s["events"]
    assert s["avg_bits"] == pytest.approx(2.0, abs=0.01)


def test_guard_off_obeys_bits() -> None:
    ctl = _train(freq=12.0, bits=2, bit_choices=(2, 4, 8), guard=False)
    s = ctl.stats()
    ctl.detach()
    assert not [e for e in s["events"] if e["kind"] == "guard"]
    assert {e["name"]: e for e in s["layers"]}["wiggle"]["next_bits"] == 2


def test_budget_that_needs_diverging_bits_is_reported() -> None:
    ctl = _train(freq=12.0, steps=1, bits=2, bit_choices=(2, 4, 8), allow_keep=False, guard_bound=0.3)
    s = ctl.stats()
    # a budget that holds every layer at 2 bits and hardly a byte more
    need = s["static_bytes"] + s["packed_bytes"] + s["other_bytes"]
    ctl.set_budget(int(need * 1.002 / (1 - ctl.config.margin_fraction)))
    with pytest.warns(RuntimeWarning, match="can only be met"):
        _steps(ctl, 6, seed=5)
    s = ctl.stats()
    ctl.detach()
    kinds = [e["kind"] for e in s["events"]]
    assert "guard" in kinds and "guard_budget" in kinds, kinds
    assert s["batch_size"] is not None and s["batch_size"] < 64
    assert {e["name"]: e for e in s["layers"]}["wiggle"]["next_bits"] >= 4


def test_loss_trend_turning_raises_the_largest_contributor() -> None:
    guard = ConvergenceGuard(tolerance=0.25, choices=(1, 2, 4, 8))
    for v in [2.3, 1.5, 0.9, 0.5, 0.3, 0.25, 0.24]:
        guard.observe_loss(v)
    assert not guard.loss_turning(step=10)
    for v in [0.6, 0.9, 1.2, 1.5]:
        guard.observe_loss(v)
    assert guard.loss_turning(step=14)
    layers = [LayerNoise("a", 1.0, 0.01), LayerNoise("b", 1.0, 5.0), LayerNoise("c", 2.0, 0.2)]
    raised = guard.raise_bits(layers, 0.5, step=14)
    assert raised == [("b", 1.0, 2.0)]
    # c keeps its 2 bits (NOTE [ A raise is not paid for with 1 bit ]); a, at 1 bit, is left as it is
    assert guard.floors == {"b": 2.0, "c": 2.0}
    assert not guard.loss_turning(step=15)  # patience after acting


def test_a_raise_is_not_paid_for_with_one_bit_elsewhere() -> None:
    guard = ConvergenceGuard(tolerance=0.25, choices=(1, 2, 4, 8))
    layers = [LayerNoise("head", 2.0, 5.0), LayerNoise("rnn", 2.0, 0.1), LayerNoise("emb", 4.0, 0.01),
              LayerNoise("tiny", 1.0, 0.001)]
    assert guard.raise_bits(layers, 0.5, step=3) == [("head", 2.0, 4.0)]
    assert guard.floors == {"head": 4.0, "rnn": 2.0, "emb": 2.0}  # 2 bits, not their widths
    # without a width of 2 bits or more below the top there is nothing to keep
    only = ConvergenceGuard(tolerance=0.25, choices=(1, 8))
    assert only.raise_bits([LayerNoise("a", 1.0, 1.0), LayerNoise("b", 1.0, 0.1)], 0.5, step=3)
    assert only.floors == {"a": 8.0}


def test_loss_guard_needs_a_history_and_ignores_noise() -> None:
    guard = ConvergenceGuard(tolerance=0.25, choices=(1, 2, 4, 8))
    for v in [2.3, 2.4, 2.2]:
        guard.observe_loss(v)
    assert not guard.loss_turning(step=3)
    for v in [2.25, 2.35, 2.3, 2.28, 2.31]:
        guard.observe_loss(v)
    assert not guard.loss_turning(step=9)  # no progress yet: nothing to turn against
    guard.observe_loss(math.nan)
    assert guard.loss_turning(step=10)  # a non-finite loss always counts


def test_observe_loss_feeds_the_guard() -> None:
    ctl = _train(freq=1.0, steps=1, bits=2)
    for v in [2.3, 1.5, 0.9, 0.5, 0.3, 0.25, 0.24, 0.8, 1.2, 1.6]:
        ctl.observe_loss(torch.tensor(v))
    assert ctl._guard.loss_turning(step=20)
    ctl.detach()
