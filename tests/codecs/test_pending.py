"""Exception lists settled after the encode (NOTE [ Exception lists without a wait ]).

On the CPU the GPU's flag and event are stood in for: a check holds a flag reader and an
object with ``query`` and ``synchronize``. The CUDA path itself is in the GPU tier
(``test_codecs_gpu.py``).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from memctl.codecs.base import Packed
from memctl.codecs.quantize import _pending
from memctl.codecs.quantize.codec import QuantizeCodec, _source_exceptions


class _Event:
    def __init__(self, passed: bool = False) -> None:
        self.passed = passed
        self.waited = 0

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.waited += 1
        self.passed = True


@pytest.fixture(autouse=True)
def _empty_queue() -> None:
    _pending._QUEUE.checks.clear()
    _pending._QUEUE.bytes = 0


def _pending_record(x: torch.Tensor, event: _Event, flag: int | None = None) -> Packed:
    """``x``'s CPU record with its exception buffers emptied and a check queued in their place."""
    codec = QuantizeCodec()
    record = codec.encode(x, bits=2, seed=7)
    empty = codec._no_exceptions(x.device)
    buffers = dict(record.buffers, exc_index=empty[0], exc_value=empty[1])
    pending = _pending.PendingBuffers(buffers, _source_exceptions)
    has = int(record.buffers["exc_index"].numel() > 0) if flag is None else flag
    queue = _pending._QUEUE
    queue.make_room(x.numel() * x.element_size())
    queue.add_check(_pending._Check(pending, x, lambda: has, event))
    return Packed(codec=record.codec, shape=record.shape, dtype=record.dtype, device=record.device,
                  buffers=pending, params=record.params)


def _data(n: int, bad: bool) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    if bad:
        x[[1, n // 2]] = torch.tensor([math.nan, -math.inf])
    return x


def test_reading_the_exceptions_waits_for_the_check_and_lists_them() -> None:
    x = _data(1000, bad=True)
    event = _Event()
    record = _pending_record(x, event)
    assert record.nbytes < QuantizeCodec().encode(x, bits=2, seed=7).nbytes  # counting waits for nothing
    assert event.waited == 0 and _pending.waiting() == 1
    got = QuantizeCodec().decode(record)
    assert event.waited == 1 and _pending.waiting() == 0
    want = QuantizeCodec().decode(QuantizeCodec().encode(x, bits=2, seed=7))
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert math.isnan(got[1]) and got[500] == -math.inf
    assert record.to_bytes() == QuantizeCodec().encode(x, bits=2, seed=7).to_bytes()


def test_a_clean_check_drops_its_input_and_keeps_the_shared_empty_lists() -> None:
    x = _data(1000, bad=False)
    record = _pending_record(x, _Event(passed=True))
    check = next(iter(_pending._QUEUE.checks.values()))
    _pending.poll()
    assert _pending.waiting() == 0 and check.source is None
    assert record.buffers["exc_index"].numel() == 0


def test_poll_settles_passed_checks_in_order_and_stops_at_the_first_not_passed() -> None:
    events = [_Event(passed=True), _Event(passed=False), _Event(passed=True)]
    records = [_pending_record(_data(300 + i, bad=True), e) for i, e in enumerate(events)]
    _pending.poll()
    assert _pending.waiting() == 2 and all(e.waited == 0 for e in events)
    assert records[0].buffers.settled and not records[1].buffers.settled
    events[1].passed = True
    _pending.poll()
    assert _pending.waiting() == 0 and records[2].buffers["exc_index"].numel() == 2


def test_the_oldest_check_is_waited_for_past_the_most_waiting() -> None:
    events = [_Event() for _ in range(_pending.MOST_WAITING + 2)]
    for i, e in enumerate(events):
        _pending_record(_data(100 + i, bad=False), e)
    assert _pending.waiting() == _pending.MOST_WAITING
    assert [e.waited for e in events[:3]] == [1, 1, 0]


def test_the_bytes_held_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pending, "MOST_WAITING_BYTES", 10_000)
    events = [_Event() for _ in range(3)]
    for i, e in enumerate(events):
        _pending_record(_data(1000 + i, bad=False), e)  # about 4 KB each
    assert _pending.waiting() == 2 and events[0].waited == 1
    assert _pending._QUEUE.bytes <= 10_000
    _pending.settle()
    assert _pending.waiting() == 0 and _pending._QUEUE.bytes == 0


def test_an_input_changed_in_place_before_its_check_decodes_to_nan(caplog: pytest.LogCaptureFixture) -> None:
    x = _data(1000, bad=True)
    record = _pending_record(x, _Event())
    x.add_(1.0)  # the input's version moves on
    with caplog.at_level(logging.WARNING, logger="memctl.codecs.quantize._pending"):
        got = QuantizeCodec().decode(record)
    assert bool(torch.isnan(got).all())
    assert "changed in place" in caplog.text


def test_a_changed_input_without_a_non_finite_value_keeps_its_record() -> None:
    x = _data(1000, bad=False)
    record = _pending_record(x, _Event())
    want = QuantizeCodec().decode(QuantizeCodec().encode(x, bits=2, seed=7))
    x.mul_(3.0)
    assert torch.equal(QuantizeCodec().decode(record), want)


def test_a_half_precision_input_lists_its_exceptions_as_float32() -> None:
    x = _data(1000, bad=True).to(torch.bfloat16)
    record = _pending_record(x, _Event(passed=True))
    assert record.buffers["exc_value"].dtype is torch.float32
    got = QuantizeCodec().decode(record)
    assert got.dtype is torch.bfloat16 and math.isnan(got[1]) and got[500] == -math.inf


class _Recorded(_Event):
    """A stand-in event that a slab records after its copy."""

    def record(self, stream: object = None) -> None:
        self.recorded = True


@pytest.fixture()
def events(monkeypatch: pytest.MonkeyPatch) -> list[_Recorded]:
    """Fresh flag slabs whose copies record stand-in events, listed as they are made."""
    made: list[_Recorded] = []

    def event() -> _Recorded:
        made.append(_Recorded())
        return made[-1]

    monkeypatch.setattr(_pending._QUEUE, "event", event)
    monkeypatch.setattr(_pending._QUEUE, "_slabs", {})
    monkeypatch.setattr(_pending._QUEUE, "_taken", {})
    return made


def _slab_record(codec: QuantizeCodec, x: torch.Tensor, seed: int, flagged: bool) -> _pending.PendingBuffers:
    """``x``'s CPU record whose check waits for a slab's flag slot, set when ``flagged`` (what the
    encode kernel writes when its input holds a non-finite value), zero before that."""
    cpu = torch.device("cpu")
    flag = _pending.flag_slot(cpu)
    assert flag.item() == 0  # zeroed, the slab's later rounds too
    if flagged:
        flag += 1
    record = codec.encode(x, bits=2, seed=seed)
    empty = codec._no_exceptions(cpu)
    buffers = dict(record.buffers, exc_index=empty[0], exc_value=empty[1])
    return _pending.pend(buffers, _source_exceptions, x, flag)


def test_a_slabs_flags_travel_together_and_the_slab_comes_round_zeroed(events: list[_Recorded]) -> None:
    """Flag slots from one slab: one copy (one event) per FLUSH_EVERY checks; a wait on a check
    whose slot has not travelled sends it first; a set flag lists the exceptions; every slot
    is zero again when the slab comes round."""
    codec = QuantizeCodec()
    records = []
    for i in range(_pending.SLAB + 3):
        x = _data(200 + i, bad=i % 5 == 0)
        records.append((x, _slab_record(codec, x, i, flagged=i % 5 == 0)))
        for e in events:
            e.passed = True  # the GPU has run everything queued
        assert _pending.waiting() <= _pending.MOST_WAITING
    sent_with_room = len(events)
    assert sent_with_room <= -(-(_pending.SLAB + 3) // _pending.FLUSH_EVERY) + 1
    unsent = (_pending.SLAB + 3) % _pending.FLUSH_EVERY
    assert _pending.waiting() == unsent  # the others' copies have passed: settled by the polls
    assert all(c.event is None for c in _pending._QUEUE.checks.values())
    x, last = records[-1]
    assert last["exc_index"].numel() == 0  # its slot had not travelled: the wait sent it
    assert len(events) == sent_with_room + 1
    _pending.settle()
    assert _pending.waiting() == 0
    for i, (_, pending) in enumerate(records):
        assert pending["exc_index"].numel() == (2 if i % 5 == 0 else 0)


def test_a_slot_sent_by_a_wait_for_room_before_its_check_is_queued_still_settles(
        events: list[_Recorded], monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for one check, each encode's wait for room sends the slab (its own slot too,
    taken before its check is queued); every check still gets an event and settles."""
    monkeypatch.setattr(_pending, "MOST_WAITING", 1)
    codec = QuantizeCodec()
    pendings = []
    for i in range(6):
        x = _data(300 + i, bad=i == 3)
        pendings.append(_slab_record(codec, x, i, flagged=i == 3))
        assert _pending.waiting() <= 1
    _pending.settle()
    assert _pending.waiting() == 0
    assert [p["exc_index"].numel() for p in pendings] == [0, 0, 0, 2, 0, 0]
