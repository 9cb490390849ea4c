"""A stand-in ``pynvml`` module, so the NVML reader's paths run without a driver."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


@dataclass
class FakeNvml:
    """State behind the fake module: devices, processes, and switches that make calls fail."""

    uuids: list[str] = field(default_factory=lambda: ["GPU-aaaa1111", "GPU-bbbb2222", "GPU-cccc3333"])
    total: int = 80 * 2**30
    used: int = 10 * 2**30
    processes: list[Any] = field(default_factory=list)
    utilization: int = 42
    init_error: type[Exception] | None = None
    memory_error: type[Exception] | None = None
    utilization_error: type[Exception] | None = None
    init_calls: int = 0
    shutdown_calls: int = 0
    handles_opened: list[int] = field(default_factory=list)

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("pynvml")
        mod.NVMLError = NVMLError  # type: ignore[attr-defined]
        mod.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound  # type: ignore[attr-defined]

        def nvmlInit() -> None:
            self.init_calls += 1
            if self.init_error is not None:
                raise self.init_error()

        def nvmlShutdown() -> None:
            self.shutdown_calls += 1

        def nvmlDeviceGetCount() -> int:
            return len(self.uuids)

        def nvmlDeviceGetHandleByIndex(index: int) -> int:
            if not 0 <= index < len(self.uuids):
                raise NVMLError(f"invalid index {index}")
            self.handles_opened.append(index)
            return index

        def nvmlDeviceGetUUID(handle: int) -> str:
            return self.uuids[handle]

        def nvmlDeviceGetMemoryInfo(handle: int) -> Any:
            if self.memory_error is not None:
                raise self.memory_error()
            return types.SimpleNamespace(total=self.total, used=self.used, free=self.total - self.used)

        def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[Any]:
            return list(self.processes)

        def nvmlDeviceGetUtilizationRates(handle: int) -> Any:
            if self.utilization_error is not None:
                raise self.utilization_error()
            return types.SimpleNamespace(gpu=self.utilization, memory=0)

        for fn in (nvmlInit, nvmlShutdown, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex, nvmlDeviceGetUUID,
                   nvmlDeviceGetMemoryInfo, nvmlDeviceGetComputeRunningProcesses,
                   nvmlDeviceGetUtilizationRates):
            setattr(mod, fn.__name__, fn)
        return mod


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvml]:
    """Install a fake ``pynvml`` in ``sys.modules`` (and hide CUDA_VISIBLE_DEVICES)."""
    state = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", state.module())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield state
