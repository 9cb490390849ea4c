"""NOTE [ Bottleneck inputs ]: a linear layer that widens a narrow input keeps it at
``bottleneck_bits``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memctl
from memctl.codecs.base import Packed
from memctl.controller.bottlenecks import bottleneck_layers
from memctl.controller.packing import Saved
from memctl.errors import ConfigError


class _LowRankAdapter(nn.Module):
    """``x + B(A(x))`` with ``A``: 128 -> 8 and ``B``: 8 -> 128 (LoRA's branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(128, 8, bias=False)
        self.b = nn.Linear(8, 128, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.a(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), _LowRankAdapter(), nn.GELU(), nn.Linear(128, 10))


def test_only_widening_linear_layers_are_bottlenecks() -> None:
    assert bottleneck_layers(_model(), 8) == {"2.b": 8.0}
    assert bottleneck_layers(_model(), None) == {}
    mlp = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))  # 4x: an MLP's widening
    assert bottleneck_layers(mlp, 8) == {}
    # a language model's head widens the model's full width into the vocabulary: no bottleneck
    lm = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64), nn.Linear(64, 4096))
    assert bottleneck_layers(lm, 8) == {}


@pytest.mark.parametrize(("bits", "expected"), [(8, 8), (None, 2)])
def test_a_bottlenecks_input_is_packed_at_its_floor(bits: int | None, expected: int) -> None:
    model = _model()
    ctl = memctl.Controller(model, bits=2, bottleneck_bits=bits, min_numel=512, monitor_interval_s=0,
                            calibration_fraction=0)
    stored: dict[str, int] = {}
    pack = ctl._packer.pack

    def spy(t: torch.Tensor) -> object:
        handle = pack(t)
        if t.grad_fn is not None and t.shape == (256, 8):  # the adapter's narrow input to b
            ctl._packer.settle()
            saved = handle.saved if hasattr(handle, "saved") else handle
            assert isinstance(saved, Saved) and isinstance(saved.data, Packed)
            stored["b"] = int(saved.data.params["bits"])
        return handle

    ctl._scope._inner_pack = spy
    x, y = torch.randn(256, 32), torch.randint(0, 10, (256,))
    for _ in range(2):  # the default choice, then the allocation's
        F.cross_entropy(model(x), y).backward()
        ctl.step()
        assert stored["b"] == expected
    layers = {e["name"]: e["bits"] for e in ctl.stats()["layers"]}
    assert layers["2.b"] == expected
    ctl.detach()


def test_bottleneck_bits_are_validated() -> None:
    with pytest.raises(ConfigError, match="bottleneck_bits"):
        memctl.Controller(_model(), bottleneck_bits=3)
