"""Exception lists of CUDA records, built without waiting for the GPU at encode time.

NOTE [ Exception lists without a wait ]
The encode kernel reports in a device flag whether its input held a non-finite value
(NOTE [ Exception list ] in ``codec.py``). Reading that flag at once (``bad.item()``) waited
for the GPU to finish every op queued before the encode: once per encoded tensor, so the
CPU never ran ahead of the GPU and a training step took the CPU's time plus the GPU's
instead of the larger of the two. Now a CUDA encode copies its flag into a slot of pinned
host memory behind the kernel, records an event after the copy, and keeps a reference to
the input until the event has passed (the forward usually still holds that tensor: it is
the next op's input). The record's exception buffers are a :class:`PendingBuffers`
mapping: reading ``exc_index`` or ``exc_value`` (``decode``, ``to_bytes``) settles the
check first, waiting for that event if it has not passed. Every later CUDA encode settles
the entries whose events have passed without waiting, and :func:`settle` settles them all,
waiting for the last: the controller calls it at the end of each forward, so that no input
is held into the backward. A zero flag drops the input; a non-zero one lists the exceptions
from it, as the encode did before.

Seen on an H200 (2026-11-27): a 4-layer transformer's forward at batch 128 ended with its
last inputs (the logits among them) still held for their checks, which were settled only
by the next encode, so the memory held between the forward and the backward grew from
238 to 363 MiB; the settle at the forward's end came from that run. It waits once per
forward, for the GPU to finish the forward. The next run on the same GPU still held 363 MiB:
the 125 MiB left were the loss's input, saved after the model's forward had ended (the
cross-entropy's log-probabilities, NOTE [ Log-probabilities ] in ``logprobs.py``), whose
check waited for the backward's first unpack. A tensor saved outside the model's forward
now settles every check after its encode (a wait for the loss's few ops: the forward's
are already waited for), and each unpack settles, without waiting, what has passed.

At most :data:`MOST_WAITING` inputs, and :data:`MOST_WAITING_BYTES` of them, are held: past
either, the oldest check is waited for. That bounds both the memory an unchecked input
can hold beyond its time and how far the CPU runs ahead, which is as far as it needs: the
GPU then has that many encodes queued.

An input changed in place before its check could not give the exceptions the encode saw.
The check compares the input's version counter: a changed input whose flag is set
makes the whole record decode to NaN (the input held a non-finite value, so the step's
loss was not finite anyway), with one warning. ``Packed.nbytes`` counts the exception
buffers known so far and waits for nothing.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["MOST_WAITING", "MOST_WAITING_BYTES", "PendingBuffers", "settle", "waiting"]

MOST_WAITING = 8
"""Inputs held for their check at most; the oldest is waited for past this."""

MOST_WAITING_BYTES = 256 << 20
"""Bytes of inputs held for their check at most (any one input is held even if larger)."""

_EXCEPTION_BUFFERS = ("exc_index", "exc_value")

_log = logging.getLogger(__name__)

Lister = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""Positions and values of an input's non-finite entries (the codec's own function)."""


class _Check:
    """One record's pending check: its input, the host slot its flag lands in, the event after the copy."""

    __slots__ = ("buffers", "bytes", "event", "flag", "source", "version")

    def __init__(self, buffers: PendingBuffers, source: torch.Tensor, flag: Any, event: Any) -> None:
        self.buffers = buffers
        self.source: torch.Tensor | None = source
        self.version = source._version
        self.bytes = source.numel() * source.element_size()
        self.flag = flag  # () -> int, valid once the event has passed
        self.event = event


class _Queue:
    """The checks not yet settled, oldest first, and the pinned host slots their flags land in."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.checks: collections.OrderedDict[int, _Check] = collections.OrderedDict()
        self.bytes = 0
        self._slots: dict[torch.device, tuple[torch.Tensor, list[int]]] = {}
        self._events: list[Any] = []

    def add(self, buffers: PendingBuffers, source: torch.Tensor, flag: torch.Tensor) -> None:
        """Queue the check of a CUDA record whose encode wrote ``flag`` (one int32 on the device)."""
        with self.lock:
            self.make_room(source.numel() * source.element_size())
            host, free = self._host_slots(flag.device)
            slot = free.pop()  # never empty: each unsettled check holds one, and they are fewer
            view = host[slot:slot + 1]
            view.copy_(flag, non_blocking=True)
            event = self._events.pop() if self._events else torch.cuda.Event()
            event.record(torch.cuda.current_stream(flag.device))

            def read(view: torch.Tensor = view, slot: int = slot, free: list[int] = free) -> int:
                value = int(view[0])
                free.append(slot)
                return value

            self.add_check(_Check(buffers, source, read, event))

    def make_room(self, size: int) -> None:
        """Settle what has passed, then wait for the oldest checks until one more input of ``size``
        bytes stays within :data:`MOST_WAITING` and :data:`MOST_WAITING_BYTES`."""
        with self.lock:
            self.poll()
            while self.checks and (len(self.checks) >= MOST_WAITING
                                   or self.bytes + size > MOST_WAITING_BYTES):
                self._settle(next(iter(self.checks.values())), wait=True)

    def add_check(self, check: _Check) -> None:
        """Queue ``check`` (room made first)."""
        with self.lock:
            self.checks[id(check.buffers)] = check
            self.bytes += check.bytes

    def poll(self) -> None:
        """Settle, without waiting, the checks whose events have passed (oldest first, up to the first
        that has not)."""
        with self.lock:
            while self.checks:
                check = next(iter(self.checks.values()))
                if not check.event.query():
                    return
                self._settle(check, wait=False)

    def settle_one(self, buffers: PendingBuffers) -> None:
        with self.lock:
            check = self.checks.get(id(buffers))
            if check is not None and check.buffers is buffers:
                self._settle(check, wait=True)

    def settle_all(self) -> None:
        with self.lock:
            while self.checks:
                self._settle(next(iter(self.checks.values())), wait=True)

    def _settle(self, check: _Check, wait: bool) -> None:
        if wait:
            check.event.synchronize()
        del self.checks[id(check.buffers)]
        self.bytes -= check.bytes
        source, check.source = check.source, None
        if isinstance(check.event, torch.cuda.Event):
            self._events.append(check.event)
        if not check.flag() or source is None:
            check.buffers.settled = True
            return
        buffers = check.buffers
        if source._version != check.version:
            _log.warning(
                "a tensor with a non-finite value was changed in place before memctl listed its "
                "exceptions; its record decodes to NaN (%s, %s values)", tuple(source.shape), source.numel())
            n = source.numel()
            index = torch.arange(n, device=source.device)
            value = torch.full((n,), float("nan"), dtype=torch.float32, device=source.device)
        else:
            index, value = buffers.lister(source)
        buffers.settle_with(index, value)

    def _host_slots(self, device: torch.device) -> tuple[torch.Tensor, list[int]]:
        slots = self._slots.get(device)
        if slots is None:
            slots = self._slots[device] = (
                torch.zeros(MOST_WAITING + 1, dtype=torch.int32, pin_memory=True),
                list(range(MOST_WAITING + 1)),
            )
        return slots


_QUEUE = _Queue()


class PendingBuffers(Mapping[str, torch.Tensor]):
    """A CUDA record's buffers whose exception list waits for the encode's flag
    (NOTE [ Exception lists without a wait ]): reading ``exc_index`` or ``exc_value`` settles it.

    Iterating, ``len`` and ``values()`` (what ``Packed.nbytes`` reads) give the buffers known
    so far without waiting.
    """

    def __init__(self, buffers: dict[str, torch.Tensor], lister: Lister) -> None:
        self._buffers = buffers
        self.lister = lister
        self.settled = False

    def __getitem__(self, name: str) -> torch.Tensor:
        if not self.settled and name in _EXCEPTION_BUFFERS:
            _QUEUE.settle_one(self)  # (sets ``settled``)
        return self._buffers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    def values(self) -> Any:
        return self._buffers.values()

    def settle_with(self, index: torch.Tensor, value: torch.Tensor) -> None:
        self._buffers["exc_index"] = index
        self._buffers["exc_value"] = value
        self.settled = True

    def __repr__(self) -> str:
        return f"PendingBuffers({self._buffers!r}, settled={self.settled})"


def pend(buffers: dict[str, torch.Tensor], lister: Lister, source: torch.Tensor,
         flag: torch.Tensor) -> PendingBuffers:
    """``buffers`` (their exception buffers empty) as a mapping whose exception list waits for
    ``flag``, the encode's device flag; ``source`` is the input the list is made from."""
    pending = PendingBuffers(buffers, lister)
    _QUEUE.add(pending, source.detach(), flag)
    return pending


def settle() -> None:
    """Settle every pending check, waiting for the GPU where needed (the end of a step)."""
    if _QUEUE.checks:
        _QUEUE.settle_all()


def poll() -> None:
    """Settle the pending checks whose flags have arrived, waiting for nothing."""
    if _QUEUE.checks:
        _QUEUE.poll()


def waiting() -> int:
    """How many checks are pending."""
    return len(_QUEUE.checks)
