"""What one rank's probe contributes to the allocation step's reduction (probe_share.py)."""

from __future__ import annotations

import math

import torch

from memctl.controller.probe import ProbeResult
from memctl.controller.probe_share import ProbeShare, replay_module

NAMES = ["a", "b"]
CHOICES = (1, 2, 4)


def _share(measured: list[tuple[str, int, float]], grad_sq: float | None, floors: dict[str, float],
           loss: bool = False, disabled: bool = False) -> ProbeShare:
    result = ProbeResult(measured=measured, grad_sq=grad_sq, noise=None, added=2.0 if grad_sq else None)
    return ProbeShare(NAMES, CHOICES, result, floors, loss, disabled)


def _reduce(shares: list[ProbeShare]) -> None:
    """Play the SUM and MAX all-reduces over ``shares`` (as RankSync does over ranks)."""
    sums = [sum(v) for v in zip(*(s.sums() for s in shares), strict=True)]
    maxima = [max(v) for v in zip(*(s.maxima() for s in shares), strict=True)]
    for s in shares:
        s.receive(sums, maxima)


def test_measurements_are_averaged_over_the_ranks_that_made_them() -> None:
    r0 = _share([("a", 2, 1.0), ("b", 1, 10.0)], grad_sq=4.0, floors={})
    r1 = _share([("a", 2, 3.0), ("a", 4, 0.5), ("b", 1, math.nan)], grad_sq=None, floors={})
    _reduce([r0, r1])
    for s in (r0, r1):
        assert sorted(s.measured) == [("a", 2, 2.0), ("a", 4, 0.5), ("b", 1, 10.0)]
        assert s.grad_sq == 4.0 and s.noise is None and s.added == 2.0
        assert s.received


def test_floors_loss_and_off_are_agreed_by_max() -> None:
    r0 = _share([], None, floors={"a": 2.0})
    r1 = _share([], None, floors={"a": 4.0, "b": 2.0}, loss=True)
    r2 = _share([], None, floors={}, disabled=True)
    _reduce([r0, r1, r2])
    for s in (r0, r1, r2):
        assert s.floors == {"a": 4.0, "b": 2.0}
        assert s.loss_turning and s.disabled


def test_without_a_probe_a_rank_sends_zeros_and_keeps_its_own_when_alone() -> None:
    quiet = ProbeShare(NAMES, CHOICES, None, {}, False, False)
    assert not any(quiet.sums()) and not any(quiet.maxima())
    own = _share([("b", 4, 0.25)], grad_sq=1.0, floors={"b": 2.0})
    own.keep_local()
    assert own.measured == [("b", 4, 0.25)] and own.floors == {"b": 2.0} and own.grad_sq == 1.0


def test_replays_run_the_plain_module() -> None:
    model = torch.nn.Linear(2, 2)
    assert replay_module(model) is model


def test_uniform_replays_are_averaged_and_every_rank_fits_the_mean() -> None:
    # NOTE [ Unmeasured layers ]: the per-width factor is fitted from the ranks' mean, not by
    # each rank from its own replay (two ranks' own fits differed by 3x, and so did their bits).
    import memctl
    from memctl.controller.probe_share import apply_share

    r0 = ProbeShare(NAMES, CHOICES, ProbeResult(uniform=[(2, 1.0), (4, 0.25)]), {}, False, False)
    r1 = ProbeShare(NAMES, CHOICES, ProbeResult(uniform=[(2, 3.0), (4, math.inf)]), {}, False, False)
    _reduce([r0, r1])
    assert r0.uniform == r1.uniform == [(2, 2.0), (4, 0.25)]

    factors = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # no probe of its own: every layer is unmeasured when the share arrives
        ctl = memctl.Controller(model, opt, min_numel=16, group_size=16, monitor_interval_s=0,
                                calibration_fraction=0.0)
        for _ in range(2):
            model(torch.randn(32, 64)).square().mean().backward()
            opt.step()
        share = ProbeShare(sorted(ctl._layers), tuple(ctl.config.bit_choices),
                           ProbeResult(uniform=[(2, 2.0)]), {}, False, False)
        share.keep_local()
        apply_share(ctl, share)
        factors.append(dict(ctl._calibration.width_factors))
        ctl.detach()
    assert 2 in factors[0] and factors[0] == factors[1]


def test_absurd_draws_on_any_rank_are_agreed_by_max() -> None:
    # NOTE [ Robust measurements ]: a rank's absurd draws were dropped with its unrecorded
    # figures; now every rank marks the widest absurd width of each layer, and a replay of
    # the allocation in use that was absurd on one rank raises bits on all.
    r0 = ProbeShare(NAMES, CHOICES, ProbeResult(unsafe=[("a", 1), ("a", 2)]), {}, False, False)
    r1 = ProbeShare(NAMES, CHOICES, ProbeResult(unsafe=[("b", 1)], tail=True), {}, False, False)
    r2 = ProbeShare(NAMES, CHOICES, None, {}, False, False)
    _reduce([r0, r1, r2])
    for s in (r0, r1, r2):
        assert s.unsafe == {"a": 2, "b": 1} and s.tail
    quiet = ProbeShare(NAMES, CHOICES, ProbeResult(), {}, False, False)
    quiet.keep_local()
    assert quiet.unsafe == {} and not quiet.tail


def test_a_shared_absurd_width_becomes_a_floor_on_every_rank() -> None:
    import memctl
    from memctl.controller.probe_share import apply_share

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = memctl.Controller(model, opt, min_numel=16, group_size=16, monitor_interval_s=0,
                            bit_choices=(1, 2, 4, 8))
    model(torch.randn(32, 64)).square().mean().backward()
    opt.step()
    name = sorted(ctl._layers)[-1]
    share = ProbeShare(sorted(ctl._layers), (1, 2, 4, 8), ProbeResult(unsafe=[(name, 2)]), {}, False, False)
    share.keep_local()
    apply_share(ctl, share)
    state = ctl._layers[name]
    assert ctl._calibration.floor(state) == 4.0
    assert any(e["kind"] == "calibration_outlier" for e in ctl.stats()["events"])
    ctl.detach()
