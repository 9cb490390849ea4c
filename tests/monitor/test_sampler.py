from __future__ import annotations

import itertools
import threading
import time
import warnings

import pytest
import torch

from memctl.errors import ConfigError
from memctl.monitor import HostReader, MemorySample, NvmlReader, ReaderKind, Sampler, SamplerConfig

from .conftest import FakeNvml, NVMLError_GpuIsLost

_AFTER_NVML = ReaderKind.TORCH if torch.cuda.is_available() else ReaderKind.HOST


def _monitor_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "memctl-monitor")


def _wait_for(condition: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


class _CountingReader(HostReader):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def read(self) -> MemorySample:
        self.reads += 1
        return super().read()


class _BrokenHostReader(HostReader):
    def read(self) -> MemorySample:
        raise OSError("host memory unreadable")


@pytest.mark.parametrize("interval", [0, -1.0, float("nan"), float("inf"), True, "1", 1e6, 1e-5])
def test_interval_is_validated(interval: object) -> None:
    with pytest.raises(ConfigError, match="interval_s"):
        Sampler(HostReader(), interval_s=interval)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True, None, 10**9])
def test_capacity_is_validated(capacity: object) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        SamplerConfig(capacity=capacity)  # type: ignore[arg-type]


def test_reader_is_validated() -> None:
    with pytest.raises(ConfigError, match="select_reader"):
        Sampler("cpu")  # type: ignore[arg-type]


def test_history_is_bounded_by_capacity() -> None:
    sampler = Sampler(HostReader(), capacity=5)
    taken = [sampler.sample_now() for _ in range(12)]
    history = sampler.history()
    assert len(history) == len(sampler) == 5
    assert history == taken[-5:]  # the oldest were dropped, order kept
    assert [s.time for s in history] == sorted(s.time for s in history)
    assert sampler.latest() is taken[-1]
    assert sampler.history(limit=2) == taken[-2:]
    assert sampler.history(limit=100) == taken[-5:]
    with pytest.raises(ConfigError, match="limit"):
        sampler.history(limit=0)


def test_latest_before_any_sample() -> None:
    sampler = Sampler(HostReader())
    assert sampler.latest() is None and sampler.history() == []


def test_start_stop_are_idempotent_and_prompt() -> None:
    reader = _CountingReader()
    sampler = Sampler(reader, interval_s=60.0)  # a long interval: stop must not wait it out
    before = _monitor_threads()
    sampler.start()
    sampler.start()
    assert sampler.running and _monitor_threads() == before + 1
    _wait_for(lambda: sampler.latest() is not None)  # samples at once on start
    t0 = time.perf_counter()
    sampler.stop()
    elapsed = time.perf_counter() - t0
    sampler.stop()
    assert elapsed < 1.0
    assert not sampler.running and _monitor_threads() == before
    assert reader.reads == 1
    sampler.start()  # restartable
    _wait_for(lambda: reader.reads == 2)
    sampler.stop()
    assert _monitor_threads() == before


def test_background_sampling_fills_the_ring() -> None:
    with Sampler(HostReader(), interval_s=0.005, capacity=4) as sampler:
        _wait_for(lambda: len(sampler) == 4)
        first = sampler.history()[0]
        _wait_for(lambda: sampler.history()[0] is not first)  # keeps going, ring rolls over
    assert not sampler.running and sampler.reader is None  # the context manager closes


def test_nvml_failing_mid_run_switches_reader_once(fake_nvml: FakeNvml) -> None:
    sampler = Sampler(NvmlReader(0), capacity=10)
    assert sampler.sample_now() is not None and sampler.latest().reader is ReaderKind.NVML  # type: ignore[union-attr]
    fake_nvml.memory_error = NVMLError_GpuIsLost
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sample = sampler.sample_now()  # must not raise
        again = sampler.sample_now()
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
    assert "NVMLError_GpuIsLost" in str(caught[0].message)
    assert sample is not None and sample.reader is _AFTER_NVML
    assert again is not None and again.reader is _AFTER_NVML
    assert sampler.reader is not None and sampler.reader.name is _AFTER_NVML
    assert fake_nvml.shutdown_calls == 1  # the failed reader was released
    assert [s.reader for s in sampler.history()] == [ReaderKind.NVML, _AFTER_NVML, _AFTER_NVML]


def test_last_reader_failing_turns_monitoring_off() -> None:
    sampler = Sampler(_BrokenHostReader(), interval_s=0.005)
    with pytest.warns(RuntimeWarning, match="monitoring is off") as record:
        assert sampler.sample_now() is None
    assert len(record) == 1
    assert sampler.reader is None and sampler.sample_now() is None


def test_failure_in_the_thread_never_kills_it(fake_nvml: FakeNvml) -> None:
    sampler = Sampler(NvmlReader(0), interval_s=0.005)
    fake_nvml.memory_error = NVMLError_GpuIsLost
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler.start()
        _wait_for(lambda: sampler.latest() is not None and sampler.latest().reader is _AFTER_NVML)  # type: ignore[union-attr]
        assert sampler.running
        sampler.stop()
    assert fake_nvml.shutdown_calls == 1


def test_concurrent_readers_see_consistent_history() -> None:
    sampler = Sampler(HostReader(), interval_s=0.001, capacity=50)
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            for _ in range(200):
                h = sampler.history()
                assert len(h) <= 50
                assert all(a.time <= b.time for a, b in itertools.pairwise(h))
        except BaseException as exc:  # reported to the main thread
            errors.append(exc)

    sampler.start()
    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(50):
        sampler.sample_now()
    for t in threads:
        t.join()
    sampler.stop()
    assert errors == []
