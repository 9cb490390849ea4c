"""When the controller settles the encodes' pending exception checks (NOTE [ Exception lists
without a wait ] in ``memctl/codecs/quantize/_pending.py``), on the CPU: each quantize encode
here queues a stand-in check, as a CUDA encode queues a real one, and no input is held for its
check into the backward, neither the forward's nor the loss's saved after the forward."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import memctl
from memctl.codecs.quantize import _pending
from memctl.codecs.quantize.codec import QuantizeCodec


class _Event:
    def __init__(self) -> None:
        self.waited = 0

    def query(self) -> bool:
        return False  # never passes by itself: only a wait settles it

    def synchronize(self) -> None:
        self.waited += 1


@pytest.fixture()
def stand_in_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[_Event]]:
    """Every quantize encode queues a check whose flag reads 0 once waited for."""
    events: list[_Event] = []
    encode = QuantizeCodec.encode

    def queued(self: QuantizeCodec, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        record = encode(self, x, *args, **kwargs)
        event = _Event()
        events.append(event)
        pending = _pending.PendingBuffers(dict(record.buffers), lambda t: (t, t))
        _pending._QUEUE.make_room(x.numel() * x.element_size())
        _pending._QUEUE.add_check(_pending._Check(pending, x.detach(), lambda: 0, event))
        return record

    monkeypatch.setattr(QuantizeCodec, "encode", queued)
    _pending._QUEUE.checks.clear()
    _pending._QUEUE.bytes = 0
    yield events
    _pending._QUEUE.checks.clear()
    _pending._QUEUE.bytes = 0


def test_no_input_is_held_for_its_check_into_the_backward(stand_in_checks: list[_Event]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0, min_numel=1)
    x = torch.randn(128, 64)
    y = torch.randint(0, 512, (128,))
    try:
        for _ in range(3):
            out = model(x)
            assert _pending.waiting() == 0  # the forward's checks: settled at its end
            loss = nn.functional.cross_entropy(out, y)  # log-probabilities saved after the forward
            assert _pending.waiting() == 0
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert stand_in_checks and all(e.waited <= 1 for e in stand_in_checks)
    finally:
        ctl.detach()
