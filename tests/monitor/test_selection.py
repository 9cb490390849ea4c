from __future__ import annotations

import sys
import warnings

import pytest
import torch

from memctl.errors import ConfigError
from memctl.monitor import HostReader, NvmlReader, ReaderKind, reader_chain, select_reader

from .conftest import FakeNvml, NVMLError_LibraryNotFound

# Without a usable GPU PyTorch's allocator cannot read either, so the host reader follows NVML.
_AFTER_NVML = ReaderKind.TORCH if torch.cuda.is_available() else ReaderKind.HOST



@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_cpu_gets_the_host_reader_silently(device: object) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader = select_reader(device, activation_bytes_fn=lambda: 5)  # type: ignore[arg-type]
    assert isinstance(reader, HostReader) and reader.name is ReaderKind.HOST
    assert caught == []
    assert reader.read().activation_bytes == 5


def test_reader_chain() -> None:
    assert reader_chain("cpu") == (ReaderKind.HOST,)
    assert reader_chain("cuda:1") == (ReaderKind.NVML, ReaderKind.TORCH, ReaderKind.HOST)
    assert reader_chain("cuda", prefer_nvml=False) == (ReaderKind.TORCH, ReaderKind.HOST)


def test_bad_device_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="banana"):
        select_reader("banana")


def test_working_nvml_is_chosen(fake_nvml: FakeNvml) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader = select_reader("cuda:0")
    assert isinstance(reader, NvmlReader) and caught == []
    reader.close()
    assert fake_nvml.shutdown_calls == 1


def test_nvml_library_missing_falls_back_with_one_warning(fake_nvml: FakeNvml) -> None:
    fake_nvml.init_error = NVMLError_LibraryNotFound
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader = select_reader("cuda:0", activation_bytes_fn=lambda: 9)
    assert reader.name is _AFTER_NVML
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
    message = str(caught[0].message)
    assert "NVMLError_LibraryNotFound" in message and "'nvml' reader for cuda:0" in message
    assert reader.activation_bytes_fn is not None and reader.activation_bytes_fn() == 9
    assert fake_nvml.shutdown_calls == 0  # init failed: nothing to release


def test_pynvml_not_installed_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader = select_reader(torch.device("cuda", 0))
    assert reader.name is _AFTER_NVML
    assert len(caught) == 1 and "ModuleNotFoundError" in str(caught[0].message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without any CUDA device")
def test_torch_reader_unavailable_without_cuda() -> None:
    with pytest.warns(RuntimeWarning, match="'torch' reader for cuda") as record:
        reader = select_reader("cuda", prefer_nvml=False)
    assert len(record) == 1 and reader.name is ReaderKind.HOST
