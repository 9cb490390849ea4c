"""A recurrent layer never takes 1 bit (NOTE [ No 1 bit for a recurrent layer ], recurrent.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memctl
from memctl.controller.calibration import Calibration
from memctl.controller.recurrent import recurrent_layers


class _LM(nn.Module):
    def __init__(self, kind: type[nn.RNNBase]) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, 64)
        self.rnn = kind(64, 64, batch_first=True)
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.mid(self.tok(idx)))[0])


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_a_recurrent_layer_stays_at_two_bits_where_others_take_one(
        kind: type[nn.RNNBase], monkeypatch: pytest.MonkeyPatch) -> None:
    # as if every layer's 1 bit had been measured (the calibration's own floor lifted)
    monkeypatch.setattr(Calibration, "floor", lambda self, state: None)
    torch.manual_seed(0)
    model = _LM(kind)
    assert recurrent_layers(model) == {"rnn"}
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=1, min_numel=256, calibration_fraction=0,
                            allocation_interval=1, monitor_interval_s=0, head_bits=None)
    for _ in range(3):
        idx = torch.randint(0, 32, (8, 24))
        out = model(idx)
        F.cross_entropy(out.reshape(-1, 32), torch.randint(0, 32, (8 * 24,))).backward()
        opt.step()
        opt.zero_grad()
    bits = {layer["name"]: layer["bits"] for layer in ctl.stats()["layers"] if layer["bits"] is not None}
    assert bits["rnn"] == 2.0
    assert bits["mid"] == 1.0


def test_no_recurrent_layers_in_a_model_without_them() -> None:
    assert recurrent_layers(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) == frozenset()
