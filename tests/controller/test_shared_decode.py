"""One decode for the nodes that save the same tensor (NOTE [ One decode for several readers ])."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

from memctl.controller.config import ControllerConfig
from memctl.controller.packing import Packer, Saved
from memctl.controller.shared_decode import OLDER, OLDER_BYTES, SharedDecode
from tests.controller.packers import strict_packer


def _packer() -> Packer:
    return strict_packer(ControllerConfig(min_numel=0))


def _count_decodes(packer: Packer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    codec: Any = packer._codec("quantize")
    calls = [0]
    inner = codec.decode

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return inner(*args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(codec, "decode", counted)
    return calls


def _grads(share: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    x = torch.randn(128, 64)
    packer = _packer()
    if not share:
        monkeypatch.setattr(SharedDecode, "keep", lambda self, saved, out: None)
    calls = _count_decodes(packer, monkeypatch)
    packer.begin_step(0)
    with torch.autograd.graph.saved_tensors_hooks(packer.pack, packer.unpack):
        loss = model(x).square().mean()
    loss.backward()
    monkeypatch.undo()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], calls[0]


def test_a_tensor_saved_twice_is_decoded_once_same_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each ReLU output is saved by the ReLU (its result) and by the next Linear (its input).
    shared, decodes_shared = _grads(True, monkeypatch)
    alone, decodes_alone = _grads(False, monkeypatch)
    assert decodes_alone - decodes_shared == 2  # one decode fewer per ReLU output
    assert all(torch.equal(a, b) for a, b in zip(shared, alone, strict=True))


def test_the_held_tensor_goes_with_its_last_reader() -> None:
    packer = _packer()
    y = torch.relu(torch.randn(4096, requires_grad=True))
    saved = packer.pack(y)
    assert isinstance(saved, Saved)
    assert packer.pack(y) is saved and saved.readers == 2
    first = packer.unpack(saved)
    assert packer._shared.held is first
    assert packer.unpack(saved) is first
    assert packer._shared.held is None  # both readers served: nothing held


def test_a_dropped_record_releases_its_tensor() -> None:
    shared = SharedDecode()

    class Record:
        readers = 2

    record = Record()
    out = torch.ones(8)
    assert shared.take(record) is None
    shared.keep(record, out)
    assert shared.held is out
    del record
    gc.collect()
    assert shared.held is None


def test_only_records_with_readers_to_come_are_held() -> None:
    shared = SharedDecode()

    class Record:
        readers = 1

    record = Record()
    assert shared.take(record) is None
    shared.keep(record, torch.ones(4))
    assert shared.held is None


class _Record:
    def __init__(self, readers: int) -> None:
        self.readers = readers


def test_a_few_small_tensors_are_held_between_readers() -> None:
    """A GRU's hidden state is read again after a few other records were decoded."""
    shared = SharedDecode()
    far = _Record(2)
    assert shared.take(far) is None
    kept = torch.ones(4096)
    shared.keep(far, kept)
    between = [_Record(2) for _ in range(OLDER)]
    for record in between:
        assert shared.take(record) is None
        shared.keep(record, torch.zeros(4096))
    assert shared.take(far) is kept  # the oldest of OLDER + 1 entries, still there
    assert shared.take(between[0]) is not None and shared.held is not None
    # served twice: neither is held any more, the others are
    assert shared.take(far) is None and shared.take(between[0]) is None
    assert shared.take(between[-1]) is not None


def test_older_tensors_are_bounded_in_number_and_bytes() -> None:
    shared = SharedDecode()
    records = [_Record(2) for _ in range(OLDER + 2)]
    for record in records:
        shared.take(record)
        shared.keep(record, torch.zeros(16))
    assert shared.take(records[0]) is None  # pushed out by OLDER newer ones
    assert shared.take(records[2]) is not None
    big, small = _Record(2), _Record(2)
    shared.take(big)
    shared.keep(big, torch.zeros(OLDER_BYTES // 4 + 1))  # the newest: held whatever its size
    assert shared.held is not None and shared.held.numel() == OLDER_BYTES // 4 + 1
    shared.take(small)
    shared.keep(small, torch.zeros(16))
    assert shared.take(big) is None  # over OLDER_BYTES as an older one: released
