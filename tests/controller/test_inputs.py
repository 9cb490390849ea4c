"""The model's own inputs saved by reference (memctl/controller/inputs.py, NOTE [ Model inputs ])."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memctl
from memctl.controller import inputs, packing
from memctl.controller.versions import SavedRef
from tests.controller.packers import record_of


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 4, 3, padding=1))


def _records(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the pack hook returns, in order."""
    out: list[Any] = []
    pack = packing.Packer.pack

    def spy(self: packing.Packer, t: torch.Tensor) -> Any:
        out.append(pack(self, t))
        return out[-1]

    monkeypatch.setattr(packing.Packer, "pack", spy)
    return out


def _first_weight_grad(x: torch.Tensor, bits: int | None) -> torch.Tensor:
    """The first convolution's weight gradient (plain PyTorch when ``bits`` is None)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = None
    if bits is not None:
        ctl = memctl.Controller(model, opt, bits=float(bits), bit_choices=(bits,), monitor_interval_s=0,
                                calibration_fraction=0.0, keep_inputs=True)
    upstream = torch.randn(8, 4, 32, 32, generator=torch.Generator().manual_seed(1))
    (model(x) * upstream).sum().backward()
    if ctl is not None:
        ctl.detach()
    weight = model[0].weight
    assert weight.grad is not None
    return weight.grad.clone()


def _image() -> torch.Tensor:
    return torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def test_model_input_is_kept_by_reference_and_the_first_weight_gradient_is_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x = _image()
    ref = _first_weight_grad(x, None)
    records = _records(monkeypatch)
    got = _first_weight_grad(x, 2)
    assert any(isinstance(r, SavedRef) and r.tensor is x for r in records)
    # the first convolution reads the image and the gradient at its output: ReLU's mask is exact and
    # the second convolution's input gradient reads only its weight, so nothing quantised is read
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_without_it_the_first_weight_gradient_is_far_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inputs.ModelInputs, "holds", lambda self, t, ptr: False)
    x = _image()
    ref = _first_weight_grad(x, None)
    got = _first_weight_grad(x, 2)
    assert float((got - ref).norm() / ref.norm()) > 0.05


def test_an_input_that_needs_a_gradient_is_compressed(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _image().requires_grad_(True)
    records = _records(monkeypatch)
    _first_weight_grad(x, 2)
    assert not any(isinstance(r, SavedRef) and r.tensor is x for r in records)
    assert any(isinstance(r, packing.Saved) and r.shape == tuple(x.shape) for r in map(record_of, records))


def test_a_tensor_computed_in_the_forward_is_compressed(monkeypatch: pytest.MonkeyPatch) -> None:
    class Normalising(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x * 0.5)

    model = Normalising()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    records = _records(monkeypatch)
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0, keep_inputs=True)
    model(_image()).sum().backward()
    ctl.detach()
    kept = [r.tensor for r in records if isinstance(r, SavedRef)]
    assert kept and all(isinstance(t, nn.Parameter) for t in kept)  # the weights only


def test_input_modified_in_place_before_backward_raises_like_plain_pytorch() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0, keep_inputs=True)
    x = _image()
    out = model(x)
    x.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        F.mse_loss(out, torch.zeros_like(out)).backward()
    ctl.detach()


def _saved_refs_of(x: torch.Tensor, monkeypatch: pytest.MonkeyPatch, **options: Any) -> list[Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    records = _records(monkeypatch)
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0, **options)
    model(x).sum().backward()
    ctl.detach()
    return [r for r in records if isinstance(r, SavedRef) and r.tensor is x]


def test_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _saved_refs_of(_image(), monkeypatch)


def test_keep_inputs_false_compresses_the_input(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not _saved_refs_of(_image(), monkeypatch, keep_inputs=False)


def test_token_ids_are_kept_by_reference_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lossless copy of ids the caller holds would only add memory."""
    ids = torch.randint(0, 50, (4, 32), generator=torch.Generator().manual_seed(0))

    def embedding_grad(**options: Any) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        ctl = memctl.Controller(model, opt, monitor_interval_s=0, calibration_fraction=0.0,
                                **options) if options else None
        model(ids).sum().backward()
        if ctl is not None:
            assert ctl.stats()["fallbacks"] == 0
            ctl.detach()
        grad = model[0].weight.grad
        assert grad is not None
        return grad

    ref = embedding_grad()
    records = _records(monkeypatch)
    got = embedding_grad(bits=2.0, bit_choices=(2,))
    assert any(isinstance(r, SavedRef) and r.tensor is ids for r in records)
    torch.testing.assert_close(got, ref)
