"""When the snapshot is rebuilt (NOTE [ Lazy publication ], ``memctl/controller/publication.py``)."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

import memctl
from memctl.controller.publication import Publication


class _Counter:
    def __init__(self) -> None:
        self.calls = 0
        self.publication: Publication | None = None

    def __call__(self) -> None:
        self.calls += 1
        assert self.publication is not None
        self.publication.published()


def _publication(interval: int = 5) -> tuple[Publication, _Counter]:
    counter = _Counter()
    publication = Publication(counter, interval)
    counter.publication = publication
    return publication, counter


def _in_thread(fn: Any) -> None:
    worker = threading.Thread(target=fn)
    worker.start()
    worker.join()


def test_quiet_boundaries_only_mark_the_snapshot_stale_until_the_interval() -> None:
    publication, built = _publication(interval=3)
    publication.boundary()
    publication.boundary()
    assert built.calls == 0
    publication.boundary()
    assert built.calls == 1


def test_an_event_publishes_at_the_next_boundary() -> None:
    publication, built = _publication()
    publication.changed = True
    publication.boundary()
    assert built.calls == 1
    publication.boundary()
    assert built.calls == 1


def test_a_read_in_the_boundary_thread_rebuilds_a_stale_snapshot_at_once() -> None:
    publication, built = _publication()
    publication.boundary()
    publication.refresh()
    assert built.calls == 1
    publication.refresh()  # fresh now: nothing to do
    assert built.calls == 1


def test_a_read_from_another_thread_never_builds_and_asks_the_next_boundary() -> None:
    publication, built = _publication()
    publication.boundary()
    _in_thread(publication.refresh)
    assert built.calls == 0 and publication.wanted
    publication.boundary()
    assert built.calls == 1 and not publication.wanted


def _train(ctl: memctl.Controller, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_controller_stats_see_every_step_and_other_threads_the_published_one() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=2, min_numel=64, monitor_interval_s=0, allocation_interval=10,
                            calibration_fraction=0.0)
    try:
        _train(ctl, model, opt, 3)  # step 0 allocates (an event); steps 1 and 2 are quiet
        seen: list[int] = []
        _in_thread(lambda: seen.append(ctl.snapshot()["step"]))
        assert seen == [1]  # published at the allocation; the quiet boundaries did not rebuild
        assert ctl.stats()["step"] == 3  # the training thread rebuilds at once
        _train(ctl, model, opt, 1)
        _in_thread(lambda: seen.append(ctl.snapshot()["step"]))
        _train(ctl, model, opt, 1)  # the other thread asked: this boundary publishes
        _in_thread(lambda: seen.append(ctl.snapshot()["step"]))
        assert seen == [1, 3, 5]
    finally:
        ctl.detach()


def test_while_serving_every_boundary_publishes() -> None:
    publication, built = _publication(interval=100)
    publication.serving = True
    publication.boundary()
    publication.boundary()
    assert built.calls == 2


def test_serving_publishes_the_current_step_for_the_server_threads() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=2, min_numel=64, monitor_interval_s=0, calibration_fraction=0.0)
    try:
        _train(ctl, model, opt, 3)  # quiet boundaries after the first: the snapshot is stale
        ctl.serve(port=0)
        seen: list[int] = []
        _in_thread(lambda: seen.append(ctl.snapshot()["step"]))
        _train(ctl, model, opt, 1)
        _in_thread(lambda: seen.append(ctl.snapshot()["step"]))
        assert seen == [3, 4]
    finally:
        ctl.detach()
