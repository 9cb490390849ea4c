"""Memory readers: the :class:`MemoryReader` protocol, the host reader and PyTorch's allocator.

The NVML reader lives in :mod:`memctl.monitor.nvml`; :func:`memctl.monitor.select_reader`
picks one for a device.
"""

from __future__ import annotations

import os
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from memctl.errors import ConfigError, CudaUnavailableError
from memctl.monitor.sample import ActivationBytesFn, MemorySample, ReaderKind

if TYPE_CHECKING:
    import torch

__all__ = ["HostReader", "MemoryReader", "TorchAllocatorReader", "cuda_index"]


@runtime_checkable
class MemoryReader(Protocol):
    """Reads one device's memory.

    ``read()`` may raise when the source fails (a driver error mid-run); the
    :class:`~memctl.monitor.Sampler` catches that and moves to the next reader, so a
    failing reader never reaches the training loop. ``close()`` releases what the
    reader holds and may be called more than once.
    """

    @property
    def name(self) -> ReaderKind:
        """Which kind of reader this is."""
        ...

    @property
    def device(self) -> str:
        """The device read, as PyTorch names it (``"cuda:0"``, ``"cpu"``)."""
        ...

    @property
    def activation_bytes_fn(self) -> ActivationBytesFn | None:
        """The controller's activation accounting, copied into every sample."""
        ...

    def read(self) -> MemorySample:
        """One sample now."""
        ...

    def close(self) -> None:
        """Release the reader's resources (idempotent)."""
        ...


class _ActivationProbe:
    """Calls the controller's activation callback; a failure warns once and reads as None."""

    # NOTE [ The activation callback never fails a read ]
    # The callback is the controller's; an error in it says nothing about the device, so
    # it must not make the sampler drop a working reader. It is reported once per reader
    # and read as "unknown" (None).

    __slots__ = ("_warned", "fn")

    def __init__(self, fn: ActivationBytesFn | None) -> None:
        self.fn = fn
        self._warned = False

    def __call__(self) -> int | None:
        if self.fn is None:
            return None
        try:
            value = self.fn()
        except Exception as exc:
            self._warn(f"raised {exc!r}")
            return None
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self._warn(f"returned {value!r}, expected a non-negative int or None")
            return None
        return value

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"memctl monitor: the activation-bytes callback {what}; "
                "samples carry activation_bytes=None while it does",
                RuntimeWarning,
                stacklevel=4,
            )


def cuda_index(device: torch.device | str | int) -> int:
    """PyTorch's index of a CUDA device (``"cuda"`` alone means the current device, else 0).

    Does not initialise CUDA: without an initialised context an index-less ``"cuda"`` is 0.
    """
    import torch

    if isinstance(device, int) and not isinstance(device, bool):
        dev = torch.device("cuda", device)
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device {device!r} is not a PyTorch device string: {exc}") from None
    if dev.type != "cuda":
        raise ConfigError(f"device {device!r} is not a CUDA device; expected 'cuda' or 'cuda:N'")
    if dev.index is not None:
        return dev.index
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


class TorchAllocatorReader:
    """PyTorch's view of a CUDA device: ``cudaMemGetInfo`` and the caching allocator.

    ``process_bytes`` is the allocator's reserved memory: it leaves out the CUDA context
    (a few hundred MiB) and memory taken outside PyTorch, which only NVML sees.

    Raises:
        CudaUnavailableError: PyTorch sees no CUDA device (a CPU build, no driver).
    """

    def __init__(self, device: torch.device | str | int = "cuda",
                 activation_bytes_fn: ActivationBytesFn | None = None) -> None:
        import torch

        self._index = cuda_index(device)
        if not torch.cuda.is_available():
            raise CudaUnavailableError(
                f"cannot read {self.device}: torch.cuda.is_available() is False "
                "(a CPU build of PyTorch, or no driver); use the host reader on this machine"
            )
        self._activation = _ActivationProbe(activation_bytes_fn)

    @property
    def name(self) -> ReaderKind:
        return ReaderKind.TORCH

    @property
    def device(self) -> str:
        return f"cuda:{self._index}"

    @property
    def activation_bytes_fn(self) -> ActivationBytesFn | None:
        return self._activation.fn

    def read(self) -> MemorySample:
        import torch

        free, total = torch.cuda.mem_get_info(self._index)
        reserved = int(torch.cuda.memory_reserved(self._index))
        return MemorySample(
            time=time.time(),
            reader=ReaderKind.TORCH,
            device=self.device,
            total_bytes=int(total),
            used_bytes=int(total) - int(free),
            free_bytes=int(free),
            process_bytes=reserved,
            allocated_bytes=int(torch.cuda.memory_allocated(self._index)),
            reserved_bytes=reserved,
            peak_bytes=int(torch.cuda.max_memory_allocated(self._index)),
            activation_bytes=self._activation(),
        )

    def close(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        return f"TorchAllocatorReader({self.device!r})"


class HostReader:
    """The host's memory: this process's resident set, the machine's (or container's) total.

    ``process_bytes`` is the resident set size from ``/proc/self/statm`` (on systems
    without ``/proc``: the *peak* resident set from ``getrusage``). Total and free come
    from ``/proc/meminfo`` (``MemAvailable`` counts as free), or ``sysconf`` without
    ``/proc``; under a cgroup-v2 memory limit smaller than the machine, the limit and the
    cgroup's usage are reported instead, since that limit is what the OOM killer enforces.
    """

    def __init__(self, activation_bytes_fn: ActivationBytesFn | None = None, *,
                 proc_root: str | os.PathLike[str] = "/proc",
                 cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup") -> None:
        self._activation = _ActivationProbe(activation_bytes_fn)
        self._proc = Path(proc_root)
        self._cgroup = Path(cgroup_root)

    @property
    def name(self) -> ReaderKind:
        return ReaderKind.HOST

    @property
    def device(self) -> str:
        return "cpu"

    @property
    def activation_bytes_fn(self) -> ActivationBytesFn | None:
        return self._activation.fn

    def read(self) -> MemorySample:
        total, free = _host_total_free(self._proc)
        limited = _cgroup_usage(self._cgroup)
        if limited is not None and limited[0] < total:
            limit, usage = limited
            total, free = limit, max(limit - usage, 0)
        return MemorySample(
            time=time.time(),
            reader=ReaderKind.HOST,
            device="cpu",
            total_bytes=total,
            used_bytes=total - free,
            free_bytes=free,
            process_bytes=_rss_bytes(self._proc),
            activation_bytes=self._activation(),
        )

    def close(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        return "HostReader()"


def _page_size() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return resource.getpagesize()


def _rss_bytes(proc: Path) -> int:
    try:
        fields = (proc / "self" / "statm").read_text().split()
        return int(fields[1]) * _page_size()
    except (OSError, IndexError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def _host_total_free(proc: Path) -> tuple[int, int]:
    try:
        info: dict[str, int] = {}
        for line in (proc / "meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                info[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
        total = info["MemTotal"]
        free = info.get("MemAvailable", info.get("MemFree", 0))
        return total, min(free, total)
    except (OSError, KeyError, ValueError):
        page = _page_size()
        total = int(os.sysconf("SC_PHYS_PAGES")) * page
        free = int(os.sysconf("SC_AVPHYS_PAGES")) * page
        return total, min(free, total)


def _cgroup_usage(root: Path) -> tuple[int, int] | None:
    """(limit, usage) of this process's cgroup-v2 memory controller, or None when unlimited."""
    try:
        limit_text = (root / "memory.max").read_text().strip()
        if limit_text == "max":
            return None
        return int(limit_text), int((root / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
