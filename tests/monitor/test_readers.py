from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from memctl.errors import ConfigError, CudaUnavailableError
from memctl.monitor import HostReader, MemoryReader, ReaderKind, TorchAllocatorReader, cuda_index


def test_host_reader_numbers_are_sane() -> None:
    reader = HostReader()
    assert isinstance(reader, MemoryReader)
    s = reader.read()
    assert s.reader is ReaderKind.HOST and s.device == "cpu"
    assert s.process_bytes is not None and s.process_bytes > 0
    assert s.total_bytes > s.used_bytes > 0
    assert s.used_bytes + s.free_bytes == s.total_bytes
    assert s.process_bytes < s.total_bytes
    assert abs(s.time - time.time()) < 5.0
    assert s.allocated_bytes is None and s.reserved_bytes is None and s.utilization is None
    reader.close()
    reader.close()  # idempotent


def test_host_reader_sees_this_process_grow() -> None:
    reader = HostReader()
    before = reader.read().process_bytes
    block = np.ones(64 * 2**20, dtype=np.uint8)  # touched pages count in the resident set
    after = reader.read().process_bytes
    assert before is not None and after is not None
    assert after - before >= 32 * 2**20
    del block


def _fake_proc(root: Path, *, total_kb: int, available_kb: int, rss_pages: int) -> Path:
    (root / "self").mkdir(parents=True)
    (root / "meminfo").write_text(
        f"MemTotal:       {total_kb} kB\nMemFree:        1 kB\nMemAvailable:   {available_kb} kB\n"
    )
    (root / "self" / "statm").write_text(f"999 {rss_pages} 10 5 0 100 0\n")
    return root


def test_host_reader_parses_proc(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path / "proc", total_kb=1000, available_kb=250, rss_pages=3)
    s = HostReader(proc_root=proc, cgroup_root=tmp_path / "nocgroup").read()
    assert (s.total_bytes, s.free_bytes, s.used_bytes) == (1000 * 1024, 250 * 1024, 750 * 1024)
    import os

    assert s.process_bytes == 3 * os.sysconf("SC_PAGE_SIZE")


def test_host_reader_reports_a_smaller_cgroup_limit(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path / "proc", total_kb=1000, available_kb=900, rss_pages=1)
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("512000\n")
    (cgroup / "memory.current").write_text("112000\n")
    s = HostReader(proc_root=proc, cgroup_root=cgroup).read()
    assert (s.total_bytes, s.used_bytes, s.free_bytes) == (512000, 112000, 400000)
    (cgroup / "memory.max").write_text("max\n")
    s = HostReader(proc_root=proc, cgroup_root=cgroup).read()
    assert s.total_bytes == 1000 * 1024


def test_host_reader_without_proc_falls_back(tmp_path: Path) -> None:
    s = HostReader(proc_root=tmp_path / "missing", cgroup_root=tmp_path / "missing").read()
    assert s.total_bytes > 0 and s.process_bytes is not None and s.process_bytes > 0


def test_activation_callback_is_copied() -> None:
    assert HostReader(lambda: 1234).read().activation_bytes == 1234
    assert HostReader(lambda: None).read().activation_bytes is None


def test_failing_activation_callback_warns_once_and_reads_none() -> None:
    def broken() -> int:
        raise KeyError("no totals yet")

    reader = HostReader(broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = reader.read(), reader.read()
    assert first.activation_bytes is None and second.activation_bytes is None
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
    assert "activation-bytes callback" in str(caught[0].message)


def test_bad_activation_value_warns_once() -> None:
    reader = HostReader(lambda: -5)
    with pytest.warns(RuntimeWarning, match="-5"):
        assert reader.read().activation_bytes is None


@pytest.mark.parametrize(
    ("device", "index"), [("cuda:2", 2), (1, 1), (torch.device("cuda", 3), 3), ("cuda", 0)]
)
def test_cuda_index(device: object, index: int) -> None:
    if device == "cuda" and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
    assert cuda_index(device) == index  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cpu", "banana", "cuda:x"])
def test_cuda_index_rejects(device: str) -> None:
    with pytest.raises(ConfigError, match="device"):
        cuda_index(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error; a GPU is present")
def test_torch_reader_without_cuda_raises_clearly() -> None:
    with pytest.raises(CudaUnavailableError, match="is_available"):
        TorchAllocatorReader("cuda:0")


@pytest.mark.gpu
def test_torch_reader_on_gpu() -> None:
    x = torch.empty(2**20, device="cuda")
    s = TorchAllocatorReader("cuda:0").read()
    assert s.reader is ReaderKind.TORCH and s.total_bytes > s.used_bytes > 0
    assert s.allocated_bytes is not None and s.allocated_bytes >= x.numel() * x.element_size()
    assert s.reserved_bytes is not None and s.reserved_bytes >= s.allocated_bytes
