"""Real-GPU tier: a training forward with memctl attached does not wait for the GPU, and holds
no input for its exception check into the backward (NOTE [ Exception lists without a wait ]);
a step boundary that uses no statistics does not wait either (NOTE [ Statistics read a step
late ]).

Skipped, with the reason, without a CUDA device.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import memctl
from memctl.codecs.quantize import _pending

pytestmark = pytest.mark.gpu


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 32 * 32, 10),
    ).cuda()


@contextlib.contextmanager
def _memctl_waits(skip_pending: bool) -> Iterator[list[str]]:
    """The synchronising calls PyTorch reports inside the block, at their innermost memctl
    frame (the model's and PyTorch's own are not counted; with ``skip_pending``, neither are
    the settles of the exception checks, in ``_pending.py``)."""
    sites: list[str] = []

    def seen(message: object, *args: object, **kwargs: object) -> None:
        if "synchroniz" in str(message):
            inner = [f for f in traceback.extract_stack() if "/memctl/" in f.filename]
            if inner and not (skip_pending and any(f.filename.endswith("_pending.py") for f in inner)):
                sites.append(f"{inner[-1].filename}:{inner[-1].lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen  # type: ignore[assignment]
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_the_forward_waits_for_the_gpu_only_to_settle_its_checks() -> None:
    """memctl's frames make no synchronising call PyTorch reports in a forward but the settle
    of its exception checks at the forward's end; the model's own are not counted."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0)
    x = torch.randn(64, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")
    for _ in range(3):  # compiled, calibrated and every place judged
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    with _memctl_waits(skip_pending=True) as sites:
        out = model(x)
        waiting = _pending.waiting()
        loss = nn.functional.cross_entropy(out, y)
    assert sites == []
    assert waiting == 0  # settled at the forward's end
    assert _pending.waiting() == 0  # the loss's input, saved after the forward: settled at its pack
    loss.backward()
    ctl.detach()


def test_a_boundary_that_uses_no_statistics_reads_them_a_step_late() -> None:
    """At a step that is no allocation, probe or guard step, ``opt.step()`` (the boundary)
    makes no synchronising call in memctl's frames; the statistics stay unfolded until a read
    in the training thread, which folds and shows them (that folding late changes nothing is
    ``test_statistics_folded_a_step_late_change_nothing``, on the CPU)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0)
    x = torch.randn(64, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")
    for _ in range(3):  # steps 0-2; step 3 allocates nothing and probes nothing
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    # A GPU that is idle could finish the statistics' copy before the boundary looks, and then
    # they are folded at once, without a wait; ~0.1 s of work queued first keeps them in flight.
    torch.cuda._sleep(200_000_000)
    with _memctl_waits(skip_pending=False) as sites:
        opt.step()
    assert sites == []
    assert ctl._unfolded is not None
    late = [(la["min"], la["max"]) for la in ctl.stats()["layers"] if la["min"] is not None]
    assert ctl._unfolded is None
    assert len(late) >= 4 and all(lo <= hi for lo, hi in late)  # the four layers' ranges
    ctl.detach()
