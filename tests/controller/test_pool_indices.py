"""Max-pool indices under the controller: stored as window positions, gradients unchanged."""

from __future__ import annotations

import torch
from torch import nn

import memctl


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 10))


def test_pool_indices_take_two_bits_and_keep_the_gradient() -> None:
    x = torch.randn(32, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    y = torch.arange(32) % 10
    ref = _model()
    nn.functional.cross_entropy(ref(x), y).backward()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # 8 bits everywhere: only the indices' layout differs from the plain run's exact path
    ctl = memctl.Controller(model, opt, bits=8.0, bit_choices=(8,), monitor_interval_s=0)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    pool = next(layer for layer in ctl.stats()["layers"] if layer["name"] == "2")
    ctl.detach()
    indices = 32 * 8 * 8 * 8
    assert pool["other_bytes"] == 2 * indices // 8  # 2 bits per index of a 2x2 window (int64: 64)
    conv_ref, conv = ref[0].weight.grad, model[0].weight.grad
    assert conv is not None and conv_ref is not None
    cos = nn.functional.cosine_similarity(conv_ref.flatten(), conv.flatten(), dim=0)
    assert cos > 0.999
