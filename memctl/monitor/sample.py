"""One reading of a device's memory: :class:`MemorySample`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from memctl.errors import ConfigError

__all__ = ["ActivationBytesFn", "MemorySample", "ReaderKind"]

#: The controller's own count of the activation bytes it holds (``None`` when unknown).
ActivationBytesFn = Callable[[], int | None]


class ReaderKind(str, Enum):
    """Where a :class:`MemorySample` came from."""

    NVML = "nvml"
    """The NVIDIA driver (nvidia-ml-py): whole-device figures, every process included."""
    TORCH = "torch"
    """PyTorch's CUDA caching allocator and ``cudaMemGetInfo``."""
    HOST = "host"
    """The host: this process's resident set and the machine's (or container's) memory."""


_OPTIONAL_BYTES = ("process_bytes", "allocated_bytes", "reserved_bytes", "peak_bytes", "activation_bytes")


@dataclass(frozen=True)
class MemorySample:
    """Memory of one device at one moment.

    Attributes:
        time: Unix time of the reading, in seconds.
        reader: Which reader produced it (``"nvml"``, ``"torch"`` or ``"host"``).
        device: The device read, as PyTorch names it (``"cuda:0"``, ``"cpu"``).
        total_bytes: The device's capacity (for the host: the machine's, or the container's limit).
        used_bytes: Bytes in use on the device by every process.
        free_bytes: Bytes still available on the device.
        process_bytes: This process's usage of the device (the host's resident set size for
            ``"host"``); ``None`` where the driver does not say.
        utilization: GPU utilisation in percent over the driver's last sample period, or ``None``.
        allocated_bytes: Bytes held by live tensors (PyTorch's allocator), or ``None``.
        reserved_bytes: Bytes the caching allocator holds from the driver, or ``None``.
        peak_bytes: Peak of ``allocated_bytes`` since the last reset, or ``None``.
        activation_bytes: The controller's own count of the compressed activations it holds,
            or ``None`` when no controller reports it.
    """

    time: float
    reader: ReaderKind
    device: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    process_bytes: int | None = None
    utilization: float | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_bytes: int | None = None
    activation_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "reader", _reader_kind(self.reader))
        if not math.isfinite(self.time):
            raise ConfigError(f"MemorySample.time must be a finite unix time, got {self.time!r}")
        for name in ("total_bytes", "used_bytes", "free_bytes"):
            _check_bytes(name, getattr(self, name), optional=False)
        for name in _OPTIONAL_BYTES:
            _check_bytes(name, getattr(self, name), optional=True)
        u = self.utilization
        if u is not None and not (isinstance(u, int | float) and 0.0 <= u <= 100.0):
            raise ConfigError(f"MemorySample.utilization must be a percentage in [0, 100] or None, got {u!r}")

    def to_dict(self) -> dict[str, Any]:
        """The sample as plain JSON-ready values (``reader`` as its string)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["reader"] = self.reader.value
        return out


def _reader_kind(value: object) -> ReaderKind:
    if isinstance(value, ReaderKind):
        return value
    try:
        return ReaderKind(value)
    except ValueError:
        allowed = ", ".join(repr(k.value) for k in ReaderKind)
        raise ConfigError(f"MemorySample.reader must be one of {allowed}, got {value!r}") from None


def _check_bytes(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        what = "a non-negative int" + (" or None" if optional else "")
        raise ConfigError(f"MemorySample.{name} must be {what}, got {value!r}")
