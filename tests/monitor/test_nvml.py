from __future__ import annotations

import os
import types

import pytest

from memctl.errors import MemctlError
from memctl.monitor import NvmlReader, ReaderKind, nvml_index

from .conftest import FakeNvml, NVMLError_GpuIsLost, NVMLError_NotSupported

_UUIDS = ["GPU-aaaa1111", "GPU-bbbb2222", "GPU-aabb3333"]


@pytest.mark.parametrize(
    ("torch_index", "visible", "expected"),
    [
        (0, None, 0),
        (2, None, 2),
        (0, "3,1", 3),
        (1, "3,1", 1),
        (1, " 2 , 0 ", 0),
        (0, "1gpu,2", 1),  # CUDA reads a leading number, like strtoul
        (1, "GPU-bbbb,GPU-aaaa", 0),  # unique UUID prefixes
        (0, "gpu-BBBB2222", None),  # not a GPU- list: parsed as integers, none found
    ],
)
def test_nvml_index_mapping(torch_index: int, visible: str | None, expected: int | None) -> None:
    if expected is None:
        with pytest.raises(MemctlError, match="not visible"):
            nvml_index(torch_index, visible, lambda: _UUIDS)
    else:
        assert nvml_index(torch_index, visible, lambda: _UUIDS) == expected


@pytest.mark.parametrize(
    ("torch_index", "visible", "needle"),
    [
        (1, "2,-1,0", "exposes 1 device"),  # a negative entry ends the list
        (0, "1,1", "exposes 0 device"),  # a repeated entry empties it
        (1, "GPU-aa,GPU-bbbb", "exposes 0 device"),  # ambiguous prefix ends the list
        (0, "MIG-1234", "MIG"),
        (-1, None, "negative"),
    ],
)
def test_nvml_index_refuses(torch_index: int, visible: str, needle: str) -> None:
    with pytest.raises(MemctlError, match=needle):
        nvml_index(torch_index, visible, lambda: _UUIDS)


def test_uuids_are_only_listed_for_uuid_lists() -> None:
    def boom() -> list[str]:
        raise AssertionError("NVML UUIDs were listed for an integer list")

    assert nvml_index(0, "1", boom) == 1


def test_reader_reads_device_and_process(fake_nvml: FakeNvml) -> None:
    me = os.getpid()
    fake_nvml.processes = [
        types.SimpleNamespace(pid=me, usedGpuMemory=3 * 2**30),
        types.SimpleNamespace(pid=me + 1, usedGpuMemory=5 * 2**30),
        types.SimpleNamespace(pid=me, usedGpuMemory=2**30),
    ]
    reader = NvmlReader(0, activation_bytes_fn=lambda: 77)
    s = reader.read()
    assert s.reader is ReaderKind.NVML and s.device == "cuda:0"
    assert (s.total_bytes, s.used_bytes, s.free_bytes) == (80 * 2**30, 10 * 2**30, 70 * 2**30)
    assert s.process_bytes == 4 * 2**30
    assert s.utilization == 42.0
    assert s.activation_bytes == 77
    reader.close()
    reader.close()
    assert fake_nvml.init_calls == 1 and fake_nvml.shutdown_calls == 1
    with pytest.raises(MemctlError, match="closed"):
        reader.read()


def test_reader_optional_figures_degrade(fake_nvml: FakeNvml) -> None:
    fake_nvml.processes = [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=None)]  # WDDM
    fake_nvml.utilization_error = NVMLError_NotSupported
    s = NvmlReader(0).read()
    assert s.process_bytes is None and s.utilization is None and s.total_bytes == 80 * 2**30


def test_reader_not_in_process_list(fake_nvml: FakeNvml) -> None:
    fake_nvml.processes = [types.SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=5)]
    assert NvmlReader(0).read().process_bytes is None


def test_reader_respects_cuda_visible_devices(fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    reader = NvmlReader("cuda:0")
    assert reader.nvml_device_index == 2 and reader.device == "cuda:0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    assert NvmlReader(0).nvml_device_index == 1


def test_failed_construction_releases_nvml(fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(MemctlError, match="not visible"):
        NvmlReader(1)
    fake_nvml.memory_error = NVMLError_GpuIsLost
    with pytest.raises(NVMLError_GpuIsLost):
        NvmlReader(0)
    assert fake_nvml.init_calls == 2 and fake_nvml.shutdown_calls == 2
