"""A norm's records in groups that divide its rows (NOTE [ Norm rows in groups of their own ],
floors.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from memctl.codecs.base import Packed
from memctl.codecs.quantize.codec import group_at
from memctl.controller.derived import Derived
from memctl.controller.floors import row_group
from tests.controller.packers import eight_bits_beside_plain, record_of, records_of


@pytest.mark.parametrize(("width", "group"), [
    (128, 128), (192, 192), (256, 256), (384, 192), (576, 192), (768, 256), (896, 224), (960, 240),
    (640, 160), (4096, 256), (72, 256), (100, 256), (64, 256), (40, 256),
])
def test_row_group_divides_the_row_or_keeps_the_configured_group(width: int, group: int) -> None:
    assert row_group(torch.empty(3, width), 256) == group
    assert row_group(torch.empty(2, 5, width), 256) == group


def test_row_group_of_a_vector_or_an_empty_row_is_the_configured_group() -> None:
    assert row_group(torch.empty(192), 256) == 256
    assert row_group(torch.empty(4, 0), 256) == 256
    assert row_group(torch.empty(4, 384), 128) == 128  # at most the configured group
    assert row_group(torch.empty(4, 192), 128) == 128  # nothing between 128 and 128 divides 192


class _RMSNorm(nn.Module):
    """Hugging Face's explicit RMSNorm (``x * rsqrt(mean(x²) + eps)``, times ``1 + w``, as Gemma's)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return n * (1.0 + self.weight)


class _Block(nn.Module):
    """A linear layer and a shift (zero: a zero input row stays zero, and the shift's gradient
    sums the norm's input gradient over rows, as the biases below a residual stream do), a
    norm, and a head."""

    def __init__(self, width: int, norm: str) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width, bias=False)
        self.shift = nn.Parameter(torch.zeros(width))
        self.norm = nn.LayerNorm(width) if norm == "layer_norm" else _RMSNorm(width)
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(x) + self.shift))


def _rows(width: int) -> torch.Tensor:
    """32 rows of 64 tokens: one token's input is all zeros (a padding embedding), one is a
    thousand times smaller than the rest (CaiT's class token beside its patch tokens)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 32, width, generator=g)
    x[0, 5] = 0.0
    x[1, 9] *= 1e-3
    return x


def _norm_inputs(ctl: Any, width: int) -> list[Any]:
    """What ``ctl``'s pack hook returns for the norm's input from now on (the shift's sum)."""
    return records_of(ctl, lambda t: tuple(t.shape) == (2, 32, width) and t.requires_grad
                      and type(t.grad_fn).__name__ == "AddBackward0")


def _relative_errors(model: nn.Module, plain: nn.Module) -> dict[str, float]:
    return {name: float((p.grad - q.grad).norm() / q.grad.norm())
            for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True)}


@pytest.mark.parametrize(("norm", "width"), [("layer_norm", 192), ("rms_norm", 192), ("layer_norm", 256)])
def test_zero_and_small_rows_keep_the_gradient_at_eight_bits(norm: str, width: int) -> None:
    """With groups of 256 spanning rows of 192, the zero row took its neighbour's step, and its
    noise came back times ``1/sqrt(eps)``: the shift's gradient (the rows' sum of the norm's
    input gradient) with a relative error of 0.13 (LayerNorm) and 0.77 (RMSNorm), the
    LayerNorm's weight 0.033; in groups of 192, at most 0.01, what 8 bits give anywhere. Rows
    of 256 fill whole groups: the configured group, a zero row's groups exact zeros."""
    torch.manual_seed(0)
    model = _Block(width, norm)
    x = _rows(width)
    plain, opt, ctl = eight_bits_beside_plain(model, x)
    norm_inputs = _norm_inputs(ctl, width)
    try:
        for _ in range(2):  # the first forward stores the record again in row groups, the second packs it so
            norm_inputs.clear()
            model.zero_grad()
            model(x).square().mean().backward()
            errors = _relative_errors(model, plain)
            assert max(errors.values()) < 0.02, errors
            stored = [record_of(s).data for s in norm_inputs]
            packed = [d.source.data if isinstance(d, Derived) else d for d in stored]
            # a Packed, or a BatchRecord (rows of 256); at 8 bits in quarters of the row's groups,
            # each within one row (NOTE [ Eight-bit groups ] in the quantize codec)
            assert packed and all(p.codec == "quantize" and p.params["group_size"] == group_at(8, width)
                                  and p.params["bits"] == 8 for p in packed)
            opt.step()
    finally:
        ctl.detach()


def test_a_norm_input_at_two_bits_is_raised_to_the_floor_in_row_groups() -> None:
    from memctl import Controller

    torch.manual_seed(0)
    model = _Block(192, "layer_norm")
    x = _rows(192)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = Controller(model, opt, bits=2.0, bit_choices=(2,), calibration_fraction=0.0, monitor_interval_s=0,
                     min_numel=0)
    found = _norm_inputs(ctl, 192)
    try:
        for _ in range(2):
            found.clear()
            model(x).square().mean().backward()
            opt.step()
            (data,) = [record_of(s).data for s in found]
            assert isinstance(data, Packed)
            assert (data.params["bits"], data.params["group_size"]) == (4, 192)
    finally:
        ctl.detach()
