"""The first optimizer steps at the widest bit choice (NOTE [ Warm-up ])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memctl
from memctl.errors import ConfigError


def _setup(**options) -> tuple[nn.Module, torch.optim.Optimizer, memctl.Controller]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctl = memctl.Controller(model, opt, min_numel=1, monitor_interval_s=0, calibration_fraction=0,
                            **options)
    return model, opt, ctl


def _steps(model: nn.Module, opt: torch.optim.Optimizer, ctl: memctl.Controller, n: int) -> list[float]:
    """Train ``n`` steps; each step's average bits as the packer saved them."""
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(n):
        x = torch.randn(32, 64, generator=g)
        y = torch.randint(0, 10, (32,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        seen.append(ctl.stats()["avg_bits"])
    return seen


def test_the_first_steps_save_at_the_widest_choice_then_the_allocations_widths_apply() -> None:
    model, opt, ctl = _setup(bits=2.0, warmup_steps=3)
    seen = _steps(model, opt, ctl, 6)
    assert seen[:3] == [8.0, 8.0, 8.0]
    assert seen[3:] == [2.0, 2.0, 2.0]
    events = [e for e in ctl.stats()["events"] if e["kind"] == "warmup"]
    assert len(events) == 1 and events[0]["step"] == 3 and "8 bits" in events[0]["message"]
    ctl.detach()

    model, opt, ctl = _setup(bits=2.0)  # off by default: 2 bits from the first step
    assert _steps(model, opt, ctl, 2) == [2.0, 2.0]
    assert not [e for e in ctl.stats()["events"] if e["kind"] == "warmup"]
    ctl.detach()


def test_a_budget_decides_during_the_warm_up() -> None:
    model, opt, ctl = _setup(budget="100%", warmup_steps=3, bit_choices=(2, 8), allow_keep=False)
    seen = _steps(model, opt, ctl, 2)
    # the budget's first step (2 bits, nothing measured yet), then what fits it: not the warm-up's 8
    assert seen[0] == 2.0
    ctl.detach()


def test_the_default_policy_warms_up_too() -> None:
    model, opt, ctl = _setup(warmup_steps=4, bit_choices=(1, 2, 4))
    seen = _steps(model, opt, ctl, 4)
    assert seen == [4.0] * 4  # the widest of the choices given
    ctl.detach()


@pytest.mark.parametrize("value", [-1, 2.5, True, "10"])
def test_warmup_steps_must_be_a_count(value) -> None:
    with pytest.raises(ConfigError, match=r"warmup_steps=.*must be an int >= 0"):
        memctl.Controller(nn.Linear(2, 2), warmup_steps=value)


def test_a_loaded_state_counts_its_steps_toward_the_warm_up() -> None:
    model, opt, ctl = _setup(bits=2.0, warmup_steps=2)
    _steps(model, opt, ctl, 3)
    state = ctl.state_dict()
    ctl.detach()
    model2, opt2, resumed = _setup(bits=2.0, warmup_steps=2)
    resumed.load_state_dict(state)
    assert _steps(model2, opt2, resumed, 1) == [2.0]  # step 3 of the run: the warm-up is over
    resumed.detach()
