"""The NVML reader: whole-device memory from the NVIDIA driver (nvidia-ml-py, module ``pynvml``).

``pynvml`` is imported and initialised only when a reader is built, never at import time.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from memctl.errors import MemctlError
from memctl.monitor.readers import _ActivationProbe, cuda_index
from memctl.monitor.sample import ActivationBytesFn, MemorySample, ReaderKind

if TYPE_CHECKING:
    import torch

__all__ = ["NvmlReader", "nvml_index"]

# NOTE [ Mapping PyTorch's device index to NVML's ]
# PyTorch numbers the devices CUDA lets it see; NVML numbers every device in the machine
# (in PCI bus order). They differ in two ways:
#   1. CUDA_VISIBLE_DEVICES="3,1" makes NVML device 3 PyTorch's cuda:0. A list of integers
#      is mapped entry by entry, with CUDA's parsing rules: an entry that is not a number
#      ends the list, a repeated entry makes the list empty.
#   2. The variable may list UUIDs ("GPU-8f3a..." — a unique prefix suffices) instead of
#      integers: each is matched against the UUIDs NVML reports. MIG instances ("MIG-...")
#      are not read by this reader: their memory is a slice of the parent device that
#      nvmlDeviceGetMemoryInfo on a device handle does not report, so building the reader
#      fails and select_reader falls back to PyTorch's allocator.
# Without CUDA_DEVICE_ORDER=PCI_BUS_ID, CUDA orders devices fastest first, which can differ
# from NVML's order on mixed machines. When PyTorch has already initialised CUDA, the
# device's own UUID (torch.cuda.get_device_properties(i).uuid) is matched instead, which
# is right whatever the ordering; before that, the environment mapping above is used.


class _NvmlMappingError(MemctlError):
    """PyTorch's device cannot be mapped to an NVML device."""


def nvml_index(torch_index: int, visible: str | None,
               nvml_uuids: Callable[[], Sequence[str]]) -> int:
    """NVML's index of PyTorch's ``cuda:<torch_index>`` under ``CUDA_VISIBLE_DEVICES=visible``.

    ``nvml_uuids`` lists the UUIDs of NVML's devices in NVML order; it is only called when
    ``visible`` lists UUIDs. See ``NOTE [ Mapping PyTorch's device index to NVML's ]``.

    Raises:
        MemctlError: the device is not visible, or is a MIG instance.
    """
    if torch_index < 0:
        raise _NvmlMappingError(f"CUDA device index {torch_index} is negative")
    if visible is None:
        return torch_index
    text = visible.strip()
    if text.startswith("MIG-"):
        raise _NvmlMappingError(
            f"CUDA_VISIBLE_DEVICES={visible!r} selects MIG instances, which the NVML reader does "
            "not read; PyTorch's allocator reader covers them"
        )
    ordinals = _uuid_ordinals(text, nvml_uuids()) if text.startswith("GPU-") else _int_ordinals(text)
    if torch_index >= len(ordinals):
        raise _NvmlMappingError(
            f"cuda:{torch_index} is not visible: CUDA_VISIBLE_DEVICES={visible!r} exposes "
            f"{len(ordinals)} device(s); use an index below {len(ordinals)}"
        )
    return ordinals[torch_index]


def _int_ordinals(text: str) -> list[int]:
    out: list[int] = []
    for entry in text.split(","):
        digits = ""
        for ch in entry.strip():
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        value = int(digits)
        if value in out:
            return []
        out.append(value)
    return out


def _uuid_ordinals(text: str, uuids: Sequence[str]) -> list[int]:
    out: list[int] = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry.startswith("GPU-"):
            break
        matches = [i for i, u in enumerate(uuids) if _norm_uuid(u).startswith(_norm_uuid(entry))]
        if len(matches) != 1:
            break
        if matches[0] in out:
            return []
        out.append(matches[0])
    return out


def _norm_uuid(uuid: str) -> str:
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def _torch_uuid(index: int) -> str | None:
    import torch

    if not torch.cuda.is_initialized():
        return None
    try:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:
        return None
    return None if uuid is None else _norm_uuid(str(uuid))


class NvmlReader:
    """Whole-device memory of one GPU from the NVIDIA driver.

    Args:
        device_index: PyTorch's device (``0``, ``"cuda:1"``); mapped to NVML's index as
            ``NOTE [ Mapping PyTorch's device index to NVML's ]`` describes.
        activation_bytes_fn: the controller's activation accounting, copied into samples.

    ``process_bytes`` sums this process's entries in the driver's list of compute
    processes; it is ``None`` when the driver withholds per-process usage (Windows WDDM)
    or the process is not found (a container with its own PID namespace). When PyTorch
    has initialised CUDA the allocator's figures (allocated, reserved, peak) are added;
    the reader never initialises CUDA itself.

    Raises:
        ImportError, pynvml.NVMLError, MemctlError: no NVML, no driver, or no such device
        (:func:`~memctl.monitor.select_reader` turns these into a fallback).
    """

    def __init__(self, device_index: int | str | torch.device = 0,
                 activation_bytes_fn: ActivationBytesFn | None = None) -> None:
        import pynvml

        self._torch_index = cuda_index(device_index)
        self._activation = _ActivationProbe(activation_bytes_fn)
        self._lock = threading.Lock()
        self._closed = False
        pynvml.nvmlInit()
        try:
            self._nvml_index = self._resolve(pynvml)
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self._nvml_index)
            pynvml.nvmlDeviceGetMemoryInfo(self._handle)  # fail here rather than mid-run
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        self._nvml: ModuleType = pynvml
        self._pid = os.getpid()

    @property
    def name(self) -> ReaderKind:
        return ReaderKind.NVML

    @property
    def device(self) -> str:
        return f"cuda:{self._torch_index}"

    @property
    def nvml_device_index(self) -> int:
        """NVML's index of the device read."""
        return self._nvml_index

    @property
    def activation_bytes_fn(self) -> ActivationBytesFn | None:
        return self._activation.fn

    def _resolve(self, nv: Any) -> int:
        def uuids() -> list[str]:
            found = []
            for i in range(int(nv.nvmlDeviceGetCount())):
                raw = nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(i))
                found.append(raw.decode() if isinstance(raw, bytes) else str(raw))
            return found

        own = _torch_uuid(self._torch_index)
        if own is not None:
            for i, uuid in enumerate(uuids()):
                if _norm_uuid(uuid) == own:
                    return i
        return nvml_index(self._torch_index, os.environ.get("CUDA_VISIBLE_DEVICES"), uuids)

    def read(self) -> MemorySample:
        with self._lock:
            if self._closed:
                raise MemctlError(f"NvmlReader for {self.device} is closed; build a new reader")
            nv = self._nvml
            mem = nv.nvmlDeviceGetMemoryInfo(self._handle)
            process = self._process_bytes()
            utilization = self._utilization()
        allocated = reserved = peak = None
        import torch

        if torch.cuda.is_initialized():
            allocated = int(torch.cuda.memory_allocated(self._torch_index))
            reserved = int(torch.cuda.memory_reserved(self._torch_index))
            peak = int(torch.cuda.max_memory_allocated(self._torch_index))
        total, free = int(mem.total), int(mem.free)
        return MemorySample(
            time=time.time(),
            reader=ReaderKind.NVML,
            device=self.device,
            total_bytes=total,
            used_bytes=max(total - free, 0),
            free_bytes=free,
            process_bytes=process,
            utilization=utilization,
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            peak_bytes=peak,
            activation_bytes=self._activation(),
        )

    def _process_bytes(self) -> int | None:
        # Optional figure: an unsupported query (or a pynvml/driver version mismatch, which
        # pynvml raises outside its NVMLError hierarchy) leaves it unknown.
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:
            return None
        used = [p.usedGpuMemory for p in procs if p.pid == self._pid]
        if not used or any(u is None for u in used):
            return None
        return int(sum(used))

    def _utilization(self) -> float | None:
        try:
            gpu = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        except Exception:
            return None
        return gpu if 0.0 <= gpu <= 100.0 else None

    def close(self) -> None:
        """Release this reader's NVML reference (``nvmlShutdown``); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(Exception):  # a lost driver cannot shut down; nothing to release
                self._nvml.nvmlShutdown()

    def __repr__(self) -> str:
        return f"NvmlReader({self.device!r}, nvml_index={self._nvml_index})"
