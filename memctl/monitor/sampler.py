"""A background thread that samples a memory reader into a bounded history.

NOTE [ Bounded shutdown ]
A reader can hang (an NVML call on a GPU that stopped answering). ``close()`` runs in
the controller's ``detach()``, often from the training loop, so it must not wait for
such a read: it waits at most ``SHUTDOWN_S`` (1 s) in all for the thread to stop and
for the read in progress to finish. If the read is still running then, the sampler is
marked closed and returns; the thread that is reading releases the reader itself when
(if) the read returns, and being a daemon thread it never holds up the interpreter's exit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from types import TracebackType

from memctl.errors import ConfigError
from memctl.monitor.readers import MemoryReader
from memctl.monitor.sample import MemorySample
from memctl.monitor.selection import fallback_reader

__all__ = ["SHUTDOWN_S", "Sampler", "SamplerConfig"]

_log = logging.getLogger("memctl.monitor")

SHUTDOWN_S = 1.0
"""Longest ``Sampler.close()`` waits for a read in progress (NOTE [ Bounded shutdown ])."""

_MIN_INTERVAL_S = 1e-3
_MAX_INTERVAL_S = 3600.0
_MAX_CAPACITY = 10_000_000


@dataclass(frozen=True)
class SamplerConfig:
    """How often to sample and how many samples to keep.

    Attributes:
        interval_s: Seconds between samples of the background thread, in [0.001, 3600].
        capacity: Samples kept (the oldest are dropped first), in [1, 10_000_000].
    """

    interval_s: float = 1.0
    capacity: int = 600

    def __post_init__(self) -> None:
        i = self.interval_s
        if (isinstance(i, bool) or not isinstance(i, int | float) or not math.isfinite(i)
                or not _MIN_INTERVAL_S <= i <= _MAX_INTERVAL_S):
            raise ConfigError(
                f"Sampler interval_s={i!r} is not allowed: give the seconds between samples as a "
                f"number in [{_MIN_INTERVAL_S}, {_MAX_INTERVAL_S}], e.g. interval_s=1.0"
            )
        c = self.capacity
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= _MAX_CAPACITY:
            raise ConfigError(
                f"Sampler capacity={c!r} is not allowed: give the number of samples to keep as an "
                f"int in [1, {_MAX_CAPACITY}], e.g. capacity=600 (ten minutes at one per second)"
            )


class Sampler:
    """Samples ``reader`` every ``interval_s`` seconds on a daemon thread.

    The last ``capacity`` samples are kept in a ring buffer. ``start()`` and ``stop()``
    are idempotent and may be repeated (the controller starts and stops the sampler
    with itself); ``stop()`` returns as soon as a read in progress finishes. Every method
    is thread-safe; ``latest()`` and ``history()`` never wait for a read.

    A reader that fails never raises into the caller: the sampler warns once
    (``RuntimeWarning``) and moves to the next reader of the device's chain
    (``NOTE [ Readers degrade, never raise ]`` in :mod:`memctl.monitor.selection`); when
    none is left, ``sample_now()`` returns ``None`` and monitoring is off.
    """

    def __init__(self, reader: MemoryReader, interval_s: float = 1.0, capacity: int = 600) -> None:
        self._config = SamplerConfig(interval_s=interval_s, capacity=capacity)
        if not isinstance(reader, MemoryReader):
            raise ConfigError(
                f"Sampler needs a memory reader (read(), close(), name, device), got {reader!r}; "
                "build one with memctl.monitor.select_reader(device)"
            )
        self._reader: MemoryReader | None = reader
        self._buffer: deque[MemorySample] = deque(maxlen=capacity)
        self._buffer_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self._closed = False

    @property
    def config(self) -> SamplerConfig:
        return self._config

    @property
    def interval_s(self) -> float:
        return self._config.interval_s

    @property
    def capacity(self) -> int:
        return self._config.capacity

    @property
    def reader(self) -> MemoryReader | None:
        """The reader in use; ``None`` once every reader has failed or after ``close()``."""
        return self._reader

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> None:
        """Sample once now, then start the background thread that samples every interval.

        A no-op when the thread runs. The first sample is taken in the caller, so
        :meth:`latest` has one as soon as ``start`` returns.
        """
        with self._state_lock:
            if self._thread is not None and self._thread.is_alive():
                return
            with contextlib.suppress(Exception):  # see _run
                self.sample_now()
            stop = threading.Event()
            thread = threading.Thread(target=self._run, args=(stop,), name="memctl-monitor", daemon=True)
            self._stop, self._thread = stop, thread
            thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the background thread and wait up to ``timeout`` s for it (no-op when stopped)."""
        with self._state_lock:
            thread, stop = self._thread, self._stop
            self._thread = self._stop = None
        if thread is None or stop is None:
            return
        stop.set()
        if thread is not threading.current_thread():
            thread.join(timeout)

    def close(self, timeout: float = SHUTDOWN_S) -> None:
        """Stop and release the reader (an NVML handle); later samples are ``None``.

        Returns within ``timeout`` seconds even while a read hangs (NOTE [ Bounded shutdown ]).
        """
        deadline = time.monotonic() + timeout
        self._closed = True
        self.stop(timeout / 2)
        if not self._read_lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            _log.warning("memctl monitor: a memory read is still running after %.1f s; the sampler "
                         "thread releases the reader when it returns", timeout)
            return
        try:
            reader, self._reader = self._reader, None
        finally:
            self._read_lock.release()
        if reader is not None:
            reader.close()

    def sample_now(self) -> MemorySample | None:
        """Read once now, record the sample and return it (``None`` when monitoring is off)."""
        with self._read_lock:
            reader = self._reader
            if reader is None:
                return None
            try:
                sample: MemorySample | None = reader.read()
            except Exception as exc:
                sample = self._fail_over(reader, exc)
            if self._closed:
                # close() came during this read (NOTE [ Bounded shutdown ]): release the reader here.
                self._reader = None
                with contextlib.suppress(Exception):
                    reader.close()
                return None
            if sample is not None:
                with self._buffer_lock:
                    self._buffer.append(sample)
            return sample

    def latest(self) -> MemorySample | None:
        """The most recent sample, or ``None`` before the first."""
        with self._buffer_lock:
            return self._buffer[-1] if self._buffer else None

    def history(self, limit: int | None = None) -> list[MemorySample]:
        """The last ``limit`` samples (all kept when ``None``), oldest first."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(f"history limit={limit!r} must be a positive int or None (everything kept)")
        with self._buffer_lock:
            samples = list(self._buffer)
        return samples if limit is None else samples[-limit:]

    def __len__(self) -> int:
        with self._buffer_lock:
            return len(self._buffer)

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Sampler({self._reader!r}, interval_s={self.interval_s}, capacity={self.capacity}, "
                f"running={self.running})")

    def _fail_over(self, reader: MemoryReader, exc: Exception) -> MemorySample | None:
        # Called with _read_lock held: walk the chain until a reader reads, then warn once.
        messages: list[str] = []
        current: MemoryReader = reader
        error: Exception = exc
        sample: MemorySample | None = None
        while True:
            nxt, message = fallback_reader(current, f"{type(error).__name__}: {error}")
            messages.append(message)
            self._reader = nxt
            if nxt is None:
                break
            try:
                sample = nxt.read()
                break
            except Exception as again:
                current, error = nxt, again
        warnings.warn("memctl monitor: " + "; then ".join(messages), RuntimeWarning, stacklevel=3)
        return sample

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self._config.interval_s):
            # sample_now() catches reader errors itself; what is left (a warning turned into
            # an error by a -W filter) must not kill the thread.
            with contextlib.suppress(Exception):
                self.sample_now()
