"""Fidelity on real data: scikit-learn's handwritten digits, full precision vs 2 bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import memctl

sklearn_datasets = pytest.importorskip("sklearn.datasets")


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        )
        self.head = nn.Linear(64 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    digits = sklearn_datasets.load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def _train(use_memctl: bool, steps: int = 300) -> tuple[float, int, int]:
    torch.manual_seed(0)
    xtr, ytr, xte, yte = _data()
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctl = memctl.Controller(model, opt, bits=2.0, monitor_interval_s=0) if use_memctl else None
    g = torch.Generator().manual_seed(1)
    raw = packed = 0
    for _ in range(steps):
        idx = torch.randint(0, len(xtr), (64,), generator=g)
        nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
        opt.zero_grad()
        if ctl is not None:
            s = ctl.stats()
            raw, packed = s["raw_bytes"], s["packed_bytes"]
    if ctl is not None:
        ctl.detach()
    model.eval()
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean()) * 100
    return acc, raw, packed


def test_two_bits_matches_full_precision_on_digits() -> None:
    base_acc, _, _ = _train(False)
    acc, raw, packed = _train(True)
    assert base_acc > 90.0, base_acc
    assert acc >= base_acc - 1.0, (base_acc, acc)
    assert raw / packed >= 10.0, (raw, packed, raw / packed)
    assert np.isfinite(acc)
