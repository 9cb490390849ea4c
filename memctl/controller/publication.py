"""When a controller rebuilds the snapshot its readers see: :class:`Publication`.

NOTE [ Lazy publication ]
The snapshot (``stats()``, the HTTP API, ``/metrics``) is a plain, immutable mapping with
a row per layer, the events, the timing histograms and the calibration's figures. Building
it costs about as much as the rest of the step boundary together, and grows with the
number of layers, while most steps nobody reads it. So the step boundary rebuilds it only
when it is wanted:

- at every boundary while the controller serves its HTTP API (``serving``): the server's
  readers are in other threads and must see each step as it ends;
- at once when something happened that readers should see (an event: an allocation, a
  budget change, the guard, an error);
- when a reader in another thread asked for the snapshot since the last rebuild;
- at least every ``interval`` boundaries (the allocation interval), so a reader's first
  look is never older than that.

Otherwise the boundary only marks the snapshot stale. A read in the thread that runs the
step boundaries (``stats()`` after ``optimizer.step()``, a trainer callback, ``serve()``)
rebuilds a stale snapshot there and then, so it always sees the step just finished. A read
from any other thread never builds (the controller's state belongs to the training
thread, and no reader may wait on the training step): it gets the last published
snapshot and asks for a rebuild at the next boundary.

On a GPU the statistics of a step are folded a step late (NOTE [ Statistics read a step
late ] in ``stats.py``), so a snapshot built at the boundary shows the previous step's
minima, maxima and sensitivities. A read in the training thread folds them first (``settle``)
and rebuilds: ``stats()`` after ``optimizer.step()`` sees the step just finished, whole.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["Publication"]

_log = logging.getLogger("memctl.controller")


class Publication:
    """Decides when ``publish`` runs (see NOTE [ Lazy publication ])."""

    __slots__ = ("_interval", "_owner", "_publish", "_settle", "_since", "_stale", "changed", "serving",
                 "wanted")

    def __init__(self, publish: Callable[[], None], interval: int,
                 settle: Callable[[], None] = lambda: None) -> None:
        self._publish = publish
        self._settle = settle
        self._interval = max(1, interval)
        self._owner = threading.get_ident()
        """The thread of the last step boundary (before the first: the controller's creator)."""
        self._since = 0
        self._stale = False
        self.changed = False
        """Set when an event is recorded: the next boundary publishes."""
        self.wanted = False
        """Set by a reader in another thread: the next boundary publishes."""
        self.serving = False
        """While the HTTP API is served: every boundary publishes."""

    def published(self) -> None:
        """The snapshot was just rebuilt (by the boundary or any other caller of ``publish``)."""
        self._stale = self.changed = self.wanted = False
        self._since = 0

    def boundary(self) -> None:
        """A step boundary ended: publish now, or mark the snapshot stale."""
        self._owner = threading.get_ident()
        self._since += 1
        if self.serving or self.changed or self.wanted or self._since >= self._interval:
            self._publish()
        else:
            self._stale = True

    def mark_stale(self) -> None:
        """The snapshot lacks what ``settle`` would fold in: the next read in the boundary's
        thread rebuilds it."""
        self._stale = True

    def refresh(self) -> None:
        """Before a read: rebuild a stale snapshot in the boundary's thread, else ask for one."""
        if not (self._stale or self.changed):
            return
        if threading.get_ident() != self._owner:
            self.wanted = True
            return
        try:
            self._settle()
            self._publish()
        except Exception as exc:  # a read never fails on this: it gets the last good snapshot
            _log.error("memctl could not rebuild its snapshot (%s: %s); showing the last one",
                       type(exc).__name__, exc, exc_info=exc)
