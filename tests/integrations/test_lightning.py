"""MemctlCallback in a real ``lightning.Trainer`` on CPU: attach, accumulation, logging, resume."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

# Skips saying why: the extra is missing, or lightning fails to import (a broken torchvision).
pytest.importorskip("memctl.integrations.lightning")

import lightning.pytorch as pl

from memctl.integrations.lightning import MemctlCallback


class TinyModule(pl.LightningModule):
    """A random-init MLP whose training_step calls a submodule, not ``self.forward``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                 nn.Linear(256, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Probe(pl.Callback):
    """Records what the memctl callback's controller reports at each batch."""

    def __init__(self, memctl_cb: MemctlCallback) -> None:
        self.cb = memctl_cb
        self.start_steps: list[int] = []
        self.end_steps: list[int] = []
        self.ratios: list[float] = []
        self.hooks_after_fit: int | None = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        assert self.cb.controller is not None and self.cb.controller.attached
        self.start_steps.append(self.cb.controller.step_count)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self.cb.controller is not None
        self.end_steps.append(self.cb.controller.step_count)
        self.ratios.append(self.cb.controller.stats()["ratio"])


def _loader() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(512, 64, generator=g), torch.randint(0, 4, (512,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=32)


def _trainer(tmp_path: Path, callbacks: list[Any], max_steps: int, accumulate: int = 1) -> Any:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
                      callbacks=callbacks, logger=pl.loggers.CSVLogger(tmp_path, name="logs"),
                      log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=tmp_path)


def _logged(trainer: Any) -> list[dict[str, str]]:
    path = Path(trainer.logger.log_dir) / "metrics.csv"
    with path.open() as f:
        return [row for row in csv.DictReader(f) if row.get("memctl/ratio")]


def test_fit_attaches_compresses_logs_and_detaches(tmp_path: Path) -> None:
    cb = MemctlCallback(bits=2.0, monitor_interval_s=0)
    probe = Probe(cb)
    model = TinyModule()
    trainer = _trainer(tmp_path, [cb, probe], max_steps=3, accumulate=2)
    trainer.fit(model, _loader())
    # Six batches, three optimizer steps: the controller steps once per optimizer step.
    assert probe.start_steps == [0, 0, 1, 1, 2, 2]
    assert probe.end_steps == [0, 1, 1, 2, 2, 3]
    assert probe.ratios[-1] > 4  # 2-bit activations of the submodules (via Controller.begin_step)
    rows = _logged(trainer)
    assert len(rows) == 3  # logged once per optimizer step
    assert float(rows[-1]["memctl/ratio"]) == pytest.approx(probe.ratios[-1])
    for key in ("memctl/avg_bits", "memctl/activation_raw_bytes", "memctl/activation_packed_bytes"):
        assert float(rows[-1][key]) > 0
    assert "memctl/budget_bytes" not in trainer.logged_metrics  # no budget: left out, never NaN
    # Detached at the end: the model is plain PyTorch again.
    assert cb.controller is None
    assert not model._forward_pre_hooks and not model.net[0]._forward_pre_hooks


def test_budget_is_logged_and_state_resumes_from_a_checkpoint(tmp_path: Path) -> None:
    cb = MemctlCallback(budget="64MiB", monitor_interval_s=0)
    model = TinyModule()
    trainer = _trainer(tmp_path / "a", [cb], max_steps=3)
    trainer.fit(model, _loader())
    assert float(_logged(trainer)[-1]["memctl/budget_bytes"]) == 64 * 2**20
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["callbacks"]
    state = next(v for k, v in saved.items() if "MemctlCallback" in k)
    assert state["step"] == 3 and state["budget"] == 64 * 2**20

    cb2 = MemctlCallback(monitor_interval_s=0)  # no budget given: the checkpoint's comes back
    probe = Probe(cb2)
    trainer2 = _trainer(tmp_path / "b", [cb2, probe], max_steps=5)
    trainer2.fit(TinyModule(), _loader(), ckpt_path=ckpt)
    assert probe.start_steps[0] == 3 and probe.end_steps[-1] == 5
    assert float(_logged(trainer2)[-1]["memctl/budget_bytes"]) == 64 * 2**20


def test_serve_exposes_the_api_while_fitting(tmp_path: Path) -> None:
    import json
    import urllib.request

    cb = MemctlCallback(bits=4.0, serve=True, monitor_interval_s=0)
    seen: list[int] = []

    class Poll(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            assert cb.url is not None
            with urllib.request.urlopen(cb.url + "/v1/stats", timeout=10) as resp:
                seen.append(json.loads(resp.read())["step"])

    _trainer(tmp_path, [cb, Poll()], max_steps=2).fit(TinyModule(), _loader())
    assert seen == [1, 2] and cb.url is None
