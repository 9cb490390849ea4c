"""What the codecs' Numba CPU kernels share (memctl.codecs._numba): disk cache, thread budget.

NOTE [ Kernel cache ] and NOTE [ Thread budget ] in :mod:`memctl.codecs._numba`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading

import numba
import pytest
import torch
from numba.core.caching import NullCache

from memctl.codecs import _numba
from memctl.codecs.errorbound import _kernels as _errorbound_kernels
from memctl.codecs.lossless import _kernels as _lossless_kernels
from memctl.codecs.quantize import _kernels as _quantize_kernels


def _caches(dispatcher: object) -> bool:
    return not isinstance(getattr(dispatcher, "_cache", None), (NullCache, type(None)))


_SECOND_PROCESS = textwrap.dedent(
    """
    import json, logging
    import numba, torch
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("memctl").addHandler(handler)
    logging.getLogger("memctl").setLevel(logging.INFO)
    from memctl import codecs
    from memctl.codecs.errorbound import _cpu as eb
    from memctl.codecs.lossless import _cpu as ll
    from memctl.codecs.quantize import _cpu as qz
    torch.set_num_threads(2)
    x = torch.randn(70_000)
    for t in (x[:500], x):
        q = codecs.get("quantize")
        q.decode(q.encode(t, bits=2), mask=t > 0)
        e = codecs.get("errorbound")
        e.decode(e.encode(t, error_bound=1e-2))
        b = codecs.get("lossless")
        b.decode(b.encode(t > 0))
    kernels = [qz.encode, qz.encode_serial, qz.decode, qz.decode_serial, ll.pack_serial, ll.unpack_serial,
               eb.plan, eb.plan_serial, eb.pack, eb.pack_serial, eb.unpack, eb.unpack_serial]
    print(json.dumps({
        "hits": sum(sum(k.stats.cache_hits.values()) for k in kernels),
        "misses": sum(sum(k.stats.cache_misses.values()) for k in kernels),
        "compiling_logged": any("compiling" in r.getMessage() for r in records),
        "layer": numba.threading_layer(),
    }))
    """
)


def test_a_second_process_loads_every_kernel_from_the_cache() -> None:
    if not _caches(_quantize_kernels.cpu_kernels().decode_serial):
        pytest.skip("Numba found no writable cache directory here (set NUMBA_CACHE_DIR)")
    _lossless_kernels.cpu_kernels()  # this process compiles (first use) or loads: the cache is filled
    _errorbound_kernels.cpu_kernels()
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    out = subprocess.run([sys.executable, "-c", _SECOND_PROCESS], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["misses"] == 0, report
    assert report["hits"] >= 8, report
    assert not report["compiling_logged"], report
    if numba.config.NUMBA_NUM_THREADS > 1:  # type: ignore[attr-defined]
        assert report["layer"] == "workqueue", report


def test_a_first_compile_is_reported_before_and_after(caplog: pytest.LogCaptureFixture) -> None:
    @numba.njit(cache=False)
    def add_one(a: int) -> int:
        return a + 1

    with caplog.at_level(logging.INFO, logger="memctl.codecs"):
        _numba.prepare("demo", [(add_one, [(numba.int64,)])])
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "compiling memctl's CPU kernels for 'demo' (first use on this machine" in messages[0]
    assert messages[1].startswith("compiled memctl's CPU kernels for 'demo' in ")
    assert len(add_one.signatures) == 1  # compiled there, not at its first call


def test_nothing_is_reported_when_the_cache_holds_the_kernels(caplog: pytest.LogCaptureFixture) -> None:
    k = _lossless_kernels.cpu_kernels()  # compiled or loaded, and so on disk when caching works
    if not _caches(k.pack_serial):
        pytest.skip("Numba found no writable cache directory here")
    sig = [(numba.uint8[::1], numba.uint8[::1])]
    with caplog.at_level(logging.INFO, logger="memctl.codecs"):
        _numba.prepare("lossless", [(k.pack_serial, sig), (k.unpack_serial, sig)])
    assert caplog.records == []


def test_parallel_kernels_follow_torchs_thread_budget() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _numba.threads() == 1
        assert _numba.launch(lambda: "parallel", lambda: "serial") == "serial"
        if numba.config.NUMBA_NUM_THREADS > 1:  # type: ignore[attr-defined]
            torch.set_num_threads(2)
            assert _numba.threads() == 2
            assert _numba.launch(numba.get_num_threads, lambda: "serial") == 2
    finally:
        torch.set_num_threads(before)


def test_a_launch_while_another_runs_takes_the_serial_kernel() -> None:
    if _numba.threads() < 2:
        pytest.skip("one thread in the budget: every launch is serial anyway")
    started, release = threading.Event(), threading.Event()
    results: list[str] = []

    def slow_parallel() -> str:
        started.set()
        release.wait(10)
        return "parallel"

    worker = threading.Thread(target=lambda: results.append(_numba.launch(slow_parallel, lambda: "serial")))
    worker.start()
    assert started.wait(10)
    assert _numba.launch(lambda: "parallel", lambda: "serial") == "serial"
    release.set()
    worker.join(10)
    assert results == ["parallel"]


def test_kernels_compile_uncached_with_one_warning_where_nothing_is_writable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from numba.core import caching

    # No cache locator applies (a read-only site-packages and no writable home or NUMBA_CACHE_DIR).
    monkeypatch.setattr(caching.FunctionCache._impl_class, "_locator_classes", [])
    monkeypatch.setattr(_numba, "_NO_CACHE_WARNED", threading.Event())

    def twice(a: int) -> int:
        return 2 * a

    def thrice(a: int) -> int:
        return 3 * a

    with caplog.at_level(logging.WARNING, logger="memctl.codecs"):
        first = _numba.cached_jit()(twice)
        second = _numba.cached_jit()(thrice)
    assert first(21) == 42 and second(2) == 6
    assert isinstance(first._cache, NullCache) and isinstance(second._cache, NullCache)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "NUMBA_CACHE_DIR" in warnings[0]
