"""Shutdown stays bounded while a memory read hangs (NOTE [ Bounded shutdown ], issue 9 item 6)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from memctl.monitor import NvmlReader, Sampler
from memctl.monitor.sampler import SHUTDOWN_S

from .conftest import FakeNvml


class _Hang:
    """Makes the fake NVML's memory query hang until released (a GPU that stopped answering)."""

    def __init__(self, fake: FakeNvml) -> None:
        module = sys.modules["pynvml"]
        self._query = module.nvmlDeviceGetMemoryInfo
        self.on = False
        self.entered = threading.Event()
        self.release = threading.Event()
        module.nvmlDeviceGetMemoryInfo = self  # type: ignore[attr-defined]

    def __call__(self, handle: int) -> Any:
        if self.on:
            self.entered.set()
            self.release.wait(60)
        return self._query(handle)


@pytest.fixture
def hang(fake_nvml: FakeNvml) -> Iterator[_Hang]:
    h = _Hang(fake_nvml)
    yield h
    h.release.set()


def test_close_returns_within_the_bound_while_an_nvml_read_hangs(fake_nvml: FakeNvml, hang: _Hang) -> None:
    sampler = Sampler(NvmlReader(0), interval_s=0.005)
    sampler.start()
    hang.on = True
    assert hang.entered.wait(10), "the sampler thread never read"
    start = time.monotonic()
    sampler.close()
    elapsed = time.monotonic() - start
    assert elapsed < SHUTDOWN_S + 0.5, f"close() took {elapsed:.2f} s with a hung read"
    assert fake_nvml.shutdown_calls == 0  # the reader is still in use by the hung read
    assert sampler.sample_now() is None


def test_the_reader_is_released_when_the_hung_read_returns(fake_nvml: FakeNvml, hang: _Hang) -> None:
    sampler = Sampler(NvmlReader(0), interval_s=0.005)
    sampler.start()
    hang.on = True
    assert hang.entered.wait(10)
    sampler.close()
    count = len(sampler)
    hang.release.set()
    deadline = time.monotonic() + 5
    while fake_nvml.shutdown_calls == 0:
        assert time.monotonic() < deadline, "the reader was never released"
        time.sleep(0.005)
    assert fake_nvml.shutdown_calls == 1
    assert sampler.reader is None and len(sampler) == count  # the late read is not recorded


def test_close_without_a_hang_releases_the_reader_at_once(fake_nvml: FakeNvml) -> None:
    sampler = Sampler(NvmlReader(0), interval_s=0.005)
    sampler.start()
    sampler.close()
    assert fake_nvml.shutdown_calls == 1 and sampler.reader is None and not sampler.running
