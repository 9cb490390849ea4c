"""NOTE [ Collector paused while records live ]: automatic garbage collection paused from a
forward's start to its backward's end, and never left paused."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import memctl


class _Probe(nn.Module):
    """A small MLP that notes whether the collector was enabled in each of its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 4)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(gc.isenabled())
        return self.b(torch.relu(self.a(x)))  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def _setup(**options: object) -> tuple[_Probe, torch.optim.Optimizer, memctl.Controller]:
    torch.manual_seed(0)
    model = _Probe()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = memctl.Controller(model, opt, bits=2, min_numel=16, group_size=16, monitor_interval_s=0,
                            calibration_fraction=0.0, **options)  # type: ignore[arg-type]
    return model, opt, ctl


def test_paused_from_the_forward_to_the_end_of_its_backward() -> None:
    model, opt, ctl = _setup()
    after_backward = []
    for _ in range(3):
        loss = model(torch.randn(64, 32)).square().mean()
        assert not gc.isenabled()  # between the forward and the backward: the records live
        loss.backward()
        after_backward.append(gc.isenabled())
        opt.step()
        opt.zero_grad()
    assert model.seen == [False, False, False] and after_backward == [True, True, True]
    assert ctl._packer.collector.pauses == 3
    ctl.detach()
    assert gc.isenabled()


def test_accumulated_micro_batches_each_resume_at_their_backward() -> None:
    model, opt, ctl = _setup()
    for _ in range(2):
        for _ in range(3):
            model(torch.randn(16, 32)).square().mean().backward()
            assert gc.isenabled()
        opt.step()
        opt.zero_grad()
    assert model.seen == [False] * 6
    ctl.detach()


def test_forwards_without_a_backward_never_leave_it_paused_for_long() -> None:
    model, _opt, ctl = _setup()
    outs = [model(torch.randn(8, 32)) for _ in range(4)]  # evaluation with gradients on
    # every second forward finds it still paused (no backward since) and runs unpaused
    assert model.seen == [False, True, False, True]
    del outs
    assert gc.isenabled()  # the fourth forward resumed it
    model(torch.randn(8, 32))
    assert not gc.isenabled()
    ctl.detach()
    assert gc.isenabled()


def test_no_grad_forwards_are_not_paused() -> None:
    model, _opt, ctl = _setup()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 32))
    assert model.seen == [True, True, True] and gc.isenabled()
    ctl.detach()


def test_a_collector_the_user_disabled_stays_disabled() -> None:
    model, opt, ctl = _setup()
    gc.disable()
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    assert not gc.isenabled() and ctl._packer.collector.pauses == 0
    ctl.detach()
    assert not gc.isenabled()


def test_detach_and_the_step_boundary_resume_it() -> None:
    model, opt, ctl = _setup()
    model(torch.randn(8, 32))  # no backward
    assert not gc.isenabled()
    opt.step()  # the boundary
    assert gc.isenabled()
    model(torch.randn(8, 32))
    assert not gc.isenabled()
    ctl.detach()
    assert gc.isenabled()


def test_off_by_option() -> None:
    model, _opt, ctl = _setup(pause_collector=False)
    model(torch.randn(8, 32)).square().mean().backward()
    assert model.seen == [True] and ctl._packer.collector.pauses == 0
    ctl.detach()


def test_a_backward_that_raises_does_not_leave_it_paused() -> None:
    model, opt, ctl = _setup()

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    out = model(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match="boom"):
        Boom.apply(out).square().mean().backward()
    # the engine ran no final callback; the next forward (or the step boundary) resumes it
    model(torch.randn(8, 32))
    assert model.seen[-1] is True
    opt.step()
    assert gc.isenabled()
    ctl.detach()
