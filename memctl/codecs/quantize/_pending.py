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

The flags live in a slab per device and stream (:data:`SLAB` int32 slots, zeroed together
once a round): an encode takes the next slot, and the slots of :data:`FLUSH_EVERY` encodes
travel to pinned memory in one copy behind one event. Each encode used to zero its own flag
and copy it alone: two launches an encode more (~10 µs of CPU each on an H200 machine, 120 a
step of the transformer of benchmarks/training.py). A check whose slot has not travelled yet
has no event: a wait for it issues the copy first, and a poll stops at it.

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
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from memctl.codecs import _backend

__all__ = ["FLUSH_EVERY", "MOST_WAITING", "MOST_WAITING_BYTES", "SLAB", "PendingBuffers", "flag_slot",
           "settle", "waiting"]

MOST_WAITING = 8
"""Inputs held for their check at most; the oldest is waited for past this."""

FLUSH_EVERY = 4
"""Encodes whose flags travel to the host in one copy."""

SLAB = 64
"""Flag slots of a device and stream, zeroed together once all are taken. More than
``MOST_WAITING + FLUSH_EVERY``: a slot's host copy is read before the slab comes round to it."""

MOST_WAITING_BYTES = 256 << 20
"""Bytes of inputs held for their check at most (any one input is held even if larger)."""

_EXCEPTION_BUFFERS = ("exc_index", "exc_value")

_log = logging.getLogger(__name__)

Lister = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""Positions and values of an input's non-finite entries (the codec's own function)."""


class _Check:
    """One record's pending check: its input, the reader of its flag, the event after the flag's
    copy (None until the copy is issued: then ``slab`` issues it)."""

    __slots__ = ("buffers", "bytes", "event", "flag", "slab", "source", "version")

    def __init__(self, buffers: PendingBuffers, source: torch.Tensor, flag: Any, event: Any,
                 slab: _Slab | None = None) -> None:
        self.buffers = buffers
        self.source: torch.Tensor | None = source
        self.version = source._version
        self.bytes = source.numel() * source.element_size()
        self.flag = flag  # () -> int, valid once the event has passed
        self.event = event
        self.slab = slab


class _Slab:
    """The flag slots of one device and stream (NOTE [ Exception lists without a wait ])."""

    def __init__(self, device: torch.device, handle: int, flags: torch.Tensor | None = None) -> None:
        """``handle``: the stream's (0 for the tests' CPU stand-ins); ``flags``: one slot already
        taken (a flag not from :func:`flag_slot`), copied alone."""
        self.handle = handle
        # the current stream, whose handle is ``handle`` (not ExternalStream(handle): for the
        # default stream, handle 0, that makes a new stream, and an event recorded there passed
        # before the flags' copy had run: seen on an H200, exceptions lost)
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.flags = torch.zeros(SLAB, dtype=torch.int32, device=device) if flags is None else flags
        self.host = torch.zeros(self.flags.numel(), dtype=torch.int32, pin_memory=self.flags.is_cuda)
        self.next = 0 if flags is None else 1
        self.unsent: list[_Check] = []
        self.first_unsent = 0

    def take(self) -> tuple[torch.Tensor, int]:
        """The next zeroed slot (a view of one int32) and its place; a full slab is sent, then zeroed."""
        if self.next == SLAB:
            self.send()
            with self._on():
                self.flags.zero_()  # behind the copy: the values travel first
            self.next = self.first_unsent = 0
        slot = self.next
        self.next += 1
        return self.flags[slot:slot + 1], slot

    def _on(self) -> Any:
        """The slab's stream made current, unless it is already (the usual case: one C call)."""
        if self.stream is None or _backend.current_stream_handle(self.flags.device) == self.handle:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def send(self) -> None:
        """Copy the slots taken since the last copy to the host, and record one event behind it for
        the checks queued since. A slot can travel before its check is queued (a wait for room
        comes between the encode and its check): its copy is then behind the event recorded for
        it later, on the same stream."""
        if self.first_unsent < self.next:
            a, b = self.first_unsent, self.next
            with self._on():
                self.host[a:b].copy_(self.flags[a:b], non_blocking=True)
            self.first_unsent = b
        if self.unsent:
            event = _QUEUE.event()
            event.record(self.stream)
            for check in self.unsent:
                check.event = event
            self.unsent = []


class _Queue:
    """The checks not yet settled, oldest first, and the pinned host slots their flags land in."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.checks: collections.OrderedDict[int, _Check] = collections.OrderedDict()
        self.bytes = 0
        self._slabs: dict[tuple[torch.device, int], _Slab] = {}
        self._taken: dict[int, tuple[_Slab, int]] = {}  # slots handed out, by address, until queued
        self._events: list[Any] = []

    def add(self, buffers: PendingBuffers, source: torch.Tensor, flag: torch.Tensor) -> None:
        """Queue the check of a CUDA record whose encode wrote ``flag``: a slot of :func:`flag_slot`
        (one int32 on the device)."""
        with self.lock:
            self.make_room(source.numel() * source.element_size())
            slab, slot = self._taken.pop(flag.data_ptr(), (None, 0))
            if slab is None:  # a flag of its own (not from a slab): copied alone
                slab = _Slab(flag.device, _handle(flag.device), flag.reshape(1))
            host = slab.host

            def read(host: torch.Tensor = host, slot: int = slot) -> int:
                return int(host[slot])

            check = _Check(buffers, source, read, None, slab)
            slab.unsent.append(check)
            self.add_check(check)
            if len(slab.unsent) >= FLUSH_EVERY or slab.flags.numel() == 1:
                slab.send()

    def flag_slot(self, device: torch.device) -> torch.Tensor:
        """A zeroed int32 flag on ``device`` for an encode on its current stream, from that
        stream's slab; :meth:`add` finds its slab by its address."""
        handle = _handle(device)
        with self.lock:
            key = (device, handle)
            slab = self._slabs.get(key)
            if slab is None:
                slab = self._slabs[key] = _Slab(device, handle)
            flag, slot = slab.take()
            self._taken[flag.data_ptr()] = (slab, slot)
            return flag

    def event(self) -> Any:
        return self._events.pop() if self._events else torch.cuda.Event()

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
                if check.event is None or not check.event.query():
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
            if check.event is None and check.slab is not None:
                check.slab.send()
            check.event.synchronize()
        del self.checks[id(check.buffers)]
        self.bytes -= check.bytes
        source, check.source = check.source, None
        event = check.event
        if isinstance(event, torch.cuda.Event) and not any(c.event is event for c in self.checks.values()):
            self._events.append(event)  # (shared by the checks of one copy: reused after the last)
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

def _handle(device: torch.device) -> int:
    """The current stream's handle on a CUDA ``device``; 0 elsewhere (the tests' CPU stand-ins)."""
    return _backend.current_stream_handle(device) if device.type == "cuda" else 0


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


def flag_slot(device: torch.device) -> torch.Tensor:
    """A zeroed int32 flag for a CUDA encode on ``device`` to write, whose check :func:`pend`
    queues (NOTE [ Exception lists without a wait ])."""
    return _QUEUE.flag_slot(device)


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
