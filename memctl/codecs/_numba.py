"""What the codecs' Numba CPU kernels share: on-disk caching, the thread budget, the compile report.

This module imports Numba at its top. Only the CPU kernel modules (``*/_cpu.py``) import it,
and they are imported on a codec's first CPU use, so ``import memctl`` compiles nothing.

NOTE [ Kernel cache ]
Every CPU kernel is a module-level function compiled with ``cache=True`` (a closure built
inside a factory cannot be cached: Numba keys a closure's cache entry on its pickled cells,
and a pickled dispatcher carries a fresh random id in every process). The first process on
a machine compiles (seconds, reported once in the log by :func:`prepare`); every later one
loads the machine code from Numba's cache: ``__pycache__`` next to the kernel module, or,
where that is not writable (a read-only site-packages), Numba's user-wide cache directory
(``~/.cache/numba``, or ``NUMBA_CACHE_DIR`` when the user sets it). Where no cache location
is writable at all, the kernels compile in every process, as before, and a warning says so
once. A cache entry is invalidated when the kernel module's source file changes (its
modification time and size) or Numba's version changes. Helpers that a kernel calls are
compiled into the kernel's cached code; a helper that lives in another module
(``_rng.lowbias32_numba``) is part of the codec's documented format and does not change.

NOTE [ Thread budget ]
PyTorch's intra-op pool and Numba's parallel kernels run on the same cores. A parallel
kernel therefore runs with ``min(NUMBA_NUM_THREADS, torch.get_num_threads())`` threads,
read at every launch (``numba.set_num_threads`` is per calling thread and costs ~2 us), and
with one thread it runs the serial compilation instead. Numba's ``workqueue`` threading
layer is chosen when the user has not chosen one (``numba.config.THREADING_LAYER`` is
"default") and Numba's pool has not started: its idle workers sleep, where an OpenMP pool's
spin and take cores from PyTorch's own OpenMP pool between kernels. ``workqueue`` does not
allow two parallel launches at once, so a launch takes a process-wide lock without waiting;
a launch that finds it held (a second thread encoding at the same moment) runs the serial
kernel, which gives the same bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numba
import torch

__all__ = ["cached_jit", "launch", "prepare", "threads"]

_log = logging.getLogger("memctl.codecs")

_F = TypeVar("_F", bound=Callable[..., Any])


def _choose_threading_layer() -> None:
    """``workqueue`` unless the user chose a layer or Numba's pool already runs (NOTE [ Thread budget ])."""
    from numba.np.ufunc import parallel as _parallel

    config: Any = numba.config
    if config.THREADING_LAYER == "default" and not getattr(_parallel, "_is_initialized", True):
        config.THREADING_LAYER = "workqueue"


_choose_threading_layer()

# The one parallel launch allowed at a time (NOTE [ Thread budget ]); protects Numba's
# process-wide thread pool, so it is process-wide too.
_PARALLEL = threading.Lock()


# Set once the process has warned that kernels cannot be cached (one warning, not one per kernel).
_NO_CACHE_WARNED = threading.Event()


def _warn_no_cache(reason: str) -> None:
    if _NO_CACHE_WARNED.is_set():
        return
    _NO_CACHE_WARNED.set()
    _log.warning(
        "memctl's CPU kernels cannot be cached on disk (%s); they compile in every process. "
        "Set NUMBA_CACHE_DIR to a writable directory to cache them", reason,
    )


def cached_jit(**options: Any) -> Callable[[_F], _F]:
    """``numba.njit(cache=True, nogil=True, **options)``, or uncached where nothing is writable."""

    def wrap(fn: _F) -> _F:
        try:
            return numba.njit(cache=True, nogil=True, **options)(fn)
        except RuntimeError as exc:  # "cannot cache function ...: no locator available"
            _warn_no_cache(str(exc))
            return numba.njit(cache=False, nogil=True, **options)(fn)

    return wrap


def threads() -> int:
    """Threads a parallel kernel may use now: Numba's pool capped by PyTorch's budget."""
    config: Any = numba.config
    return max(1, min(int(config.NUMBA_NUM_THREADS), torch.get_num_threads()))


def launch(parallel: Callable[..., Any], serial: Callable[..., Any], *args: Any) -> Any:
    """Run ``parallel(*args)`` under the thread budget, or ``serial(*args)`` (NOTE [ Thread budget ])."""
    n = threads()
    if n > 1 and _PARALLEL.acquire(blocking=False):
        try:
            numba.set_num_threads(n)
            return parallel(*args)
        finally:
            _PARALLEL.release()
    return serial(*args)


def _is_cached(dispatcher: Any, signatures: Sequence[Any]) -> bool | None:
    """Whether Numba's on-disk index holds entries for ``dispatcher``; None when unknown."""
    cache = getattr(dispatcher, "_cache", None)
    try:
        index = cache._cache_file._load_index()  # type: ignore[union-attr]
    except Exception:
        return None
    return len(index) >= len(signatures)


def prepare(codec: str, kernels: Sequence[tuple[Any, Sequence[Any]]]) -> None:
    """Make ``kernels`` (dispatcher, signatures) ready, reporting a first compile once.

    Called once per process and codec, on its first CPU use. When Numba's cache already
    holds every kernel (NOTE [ Kernel cache ]) nothing happens here: each kernel loads from
    the cache at its first launch (milliseconds). Otherwise the kernels are compiled now,
    for the signatures the codec launches them with, between two log lines, so the
    seconds this takes are reported instead of passing silently inside a training step.
    """
    states = [_is_cached(d, sigs) for d, sigs in kernels]
    if all(s is True for s in states):
        return
    cache_dir = next((str(d.stats.cache_path) for d, _ in kernels if d.stats.cache_path), None)
    where = f"cached in {cache_dir} for later processes" if cache_dir else "not cached on disk"
    _log.info(
        "compiling memctl's CPU kernels for %r (first use on this machine, ~%d s; %s)",
        codec, 5 * len(kernels) // 2, where,
    )
    start = time.perf_counter()
    for dispatcher, signatures in kernels:
        for sig in signatures:
            dispatcher.compile(sig)
    _log.info("compiled memctl's CPU kernels for %r in %.1f s", codec, time.perf_counter() - start)
