"""TensorBoardLogger writes the controller's scalars, read back from the event file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("memctl.integrations.tensorboard")  # skips naming the missing extra

import memctl
from memctl.errors import ConfigError
from memctl.integrations.tensorboard import TensorBoardLogger


def _read(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_are_written_after_each_optimizer_step(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = memctl.Controller(model, opt, budget="1GiB", monitor_interval_s=0)
    ratios = []
    with TensorBoardLogger(ctl, tmp_path) as tb:
        for _ in range(3):
            x, y = torch.randn(64, 128), torch.randint(0, 4, (64,))
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            ratios.append(ctl.stats()["ratio"])
        assert tb.log_dir == str(tmp_path)
    ctl.detach()
    opt.step()  # the logger's hook is gone: no fourth point, no error
    tags = _read(tmp_path)
    assert [s for s, _ in tags["memctl/ratio"]] == [1, 2, 3]
    assert [v for _, v in tags["memctl/ratio"]] == pytest.approx(ratios)
    assert tags["memctl/budget_bytes"][-1][1] == 2**30
    for name in ("memctl/avg_bits", "memctl/activation_raw_bytes", "memctl/activation_packed_bytes"):
        assert name in tags


def test_every_must_be_positive(tmp_path: Path) -> None:
    ctl = memctl.Controller(torch.nn.Linear(2, 2), monitor_interval_s=0)
    with pytest.raises(ConfigError, match="every=0"):
        TensorBoardLogger(ctl, tmp_path, every=0)
    ctl.detach()
