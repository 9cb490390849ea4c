"""Small tensors packed in batches of them after they are saved (NOTE [ Packs queued in the forward ])."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memctl
from memctl.controller import packing
from memctl.controller.batches import BATCH_BELOW
from memctl.controller.config import ControllerConfig
from memctl.controller.packing import Saved, _Queued
from tests.controller.models import CNN, MLP, LSTMModel, TransformerBlock, batch_for, loss_for
from tests.controller.packers import strict_packer


class _GRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(x)[0][:, -1])


def _gru_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 12, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


_MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP, "cnn": CNN, "transformer": TransformerBlock, "lstm": LSTMModel, "gru": _GRU,
}


def _train(model: nn.Module, queue: bool, steps: int = 3, **options: Any) -> tuple[list[float], list[int]]:
    """Losses and packed bytes of ``steps`` steps of ``model`` with memctl, the queue on or off
    (every tensor compressed, each with its own random draws: a record made out of order would
    change them)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # the recurrent nets on PyTorch's op: its hundreds of small tensors are what the queue is for
    options = {"calibration_fraction": 0, "fused_rnn": False, **options}
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=0, **options)
    ctl._packer._queueing = queue
    x, y = _gru_batch() if isinstance(model, _GRU) else batch_for(model)
    torch.manual_seed(1)  # dropout's draws
    losses, packed = [], []
    for _ in range(steps):
        out = model(x)
        loss = F.cross_entropy(out, y) if isinstance(model, _GRU) else loss_for(model, out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        packed.append(int(ctl.stats()["packed_bytes"]))
    ctl.detach()
    return losses, packed


@pytest.mark.parametrize("name", sorted(_MODELS))
@pytest.mark.parametrize("options", [{"bits": 2.0}, {}], ids=["bits2", "default"])
def test_queued_packs_make_the_same_records_and_weights_as_packing_at_once(
        name: str, options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = _MODELS[name]()
    twin = copy.deepcopy(model)
    queued = _train(model, True, **options)
    at_once = _train(twin, False, **options)
    assert queued == at_once
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["cnn", "gru"])
def test_queued_packs_agree_with_calibration_probes_at_every_allocation(name: str) -> None:
    """The probes replay with a packer of their own that packs at once (NOTE [ Replay ]); with
    their schedule fixed (a probe at every allocation step), training is the same either way."""
    torch.manual_seed(0)
    model = _MODELS[name]()
    twin = copy.deepcopy(model)
    options = {"calibration_fraction": 1000.0, "allocation_interval": 1}
    queued = _train(model, True, **options)
    at_once = _train(twin, False, **options)
    assert queued == at_once
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def _packer(**config: Any) -> packing.Packer:
    packer = strict_packer(ControllerConfig(min_numel=0, **config), queue=True)
    packer.begin_step(0)
    return packer


def test_a_small_tensor_waits_and_a_large_one_packs_the_queue_first() -> None:
    packer = _packer()
    small = [torch.randn(4, 256, requires_grad=True) * 2 for _ in range(3)]
    handles = [packer.pack(t) for t in small]
    assert all(isinstance(h, _Queued) and h.saved is None for h in handles)
    assert packer.packs == 0
    large = torch.randn(BATCH_BELOW, requires_grad=True) * 2
    record = packer.pack(large)
    assert isinstance(record, Saved)
    assert all(isinstance(h, _Queued) and isinstance(h.saved, Saved) and h.tensor is None for h in handles)
    assert packer.packs == 4  # the queue's three, before the large one


def test_the_queue_is_packed_when_it_holds_its_limit() -> None:
    packer = _packer()
    limit = packing._QUEUE_RECORDS
    handles = [packer.pack(torch.randn(2, 256, requires_grad=True) * 2) for _ in range(limit)]
    assert all(isinstance(h, _Queued) and h.saved is not None for h in handles)
    assert not packer._queue
    # values bound the queue too: tensors of nearly BATCH_BELOW values each, the fifth past the bound
    size = BATCH_BELOW - 256
    assert 4 * size < packing._QUEUE_VALUES <= 5 * size
    big = [packer.pack(torch.randn(size, requires_grad=True) * 2) for _ in range(4)]
    assert all(isinstance(h, _Queued) and h.saved is None for h in big)
    big.append(packer.pack(torch.randn(size, requires_grad=True) * 2))
    assert all(isinstance(h, _Queued) and h.saved is not None for h in big)
    assert not packer._queue and packer._queued_values == 0


def test_a_module_output_is_matched_after_what_the_module_saved_is_packed() -> None:
    """A ReLU's output keeps its exact region code (NOTE [ ReLU masks ]): it is found at the
    module's exit, which packs the queue first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, calibration_fraction=0, monitor_interval_s=0,
                            keep_inputs=False, min_numel=0)
    handles: list[Any] = []
    pack = ctl._packer.pack

    def spy(t: torch.Tensor) -> Any:
        handles.append(pack(t))
        return handles[-1]

    ctl._scope._pack = spy
    try:
        out = model(torch.randn(16, 64))
        assert any(isinstance(h, _Queued) for h in handles)
        assert all(not isinstance(h, _Queued) or h.tensor is None for h in handles)  # packed by now
        records = [h.saved if isinstance(h, _Queued) else h for h in handles]
        relu_out = [r for r in records if isinstance(r, Saved) and r.regions]
        assert len(relu_out) == 2, "the ReLU's output and the next layer's input keep the region code"
        out.sum().backward()
        opt.step()
    finally:
        ctl.detach()


def test_a_queued_tensor_changed_in_place_raises_autograd_error() -> None:
    """Changed in place after it was saved and before the queue was packed: the backward refuses
    it, as plain PyTorch does (NOTE [ In-place checks ])."""

    class Changes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.sigmoid(self.fc(x))  # sigmoid saves its output
            z = y * 3.0
            y.add_(1.0)  # changes what sigmoid saved
            return z

    def run(attach: bool) -> str:
        torch.manual_seed(0)
        model = Changes()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctl = memctl.Controller(model, opt, bits=2.0, calibration_fraction=0,
                                monitor_interval_s=0) if attach else None
        try:
            with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
                model(torch.randn(4, 32)).sum().backward()
        finally:
            if ctl is not None:
                ctl.detach()
        return str(info.value)

    plain, queued = run(False), run(True)
    # the same error on the same tensor and versions (the record holds the tensor detached, as a
    # batch's member changed in place does, so the message leaves out the node that made it)
    for text in (plain, queued):
        assert "[torch.FloatTensor [4, 32]]" in text and "is at version 1; expected version 0" in text
