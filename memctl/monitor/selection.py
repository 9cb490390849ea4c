"""Choosing a memory reader for a device, and the chain of fallbacks behind it."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from memctl.errors import ConfigError
from memctl.monitor.readers import HostReader, MemoryReader, TorchAllocatorReader
from memctl.monitor.sample import ActivationBytesFn, ReaderKind

if TYPE_CHECKING:
    import torch

__all__ = ["fallback_reader", "reader_chain", "select_reader"]

# NOTE [ Readers degrade, never raise ]
# Monitoring is an aid to training, not a condition of it. A CUDA device is read by NVML
# (whole-device figures, other processes included), else by PyTorch's allocator (this
# process only), else by the host reader, which always works. Whatever fails on the way
# (no pynvml, no driver, NVMLError_LibraryNotFound, a MIG device) is reported in ONE
# RuntimeWarning per fallback and never raised. The same chain serves the Sampler when a
# reader fails mid-run (a GPU falling off the bus): it moves to the next reader.
# The monitor among the controller's threads: docs/design.md, "Threading model".


def reader_chain(device: torch.device | str, *, prefer_nvml: bool = True) -> tuple[ReaderKind, ...]:
    """The readers to try for ``device``, best first."""
    if _is_cuda(device):
        if prefer_nvml:
            return (ReaderKind.NVML, ReaderKind.TORCH, ReaderKind.HOST)
        return (ReaderKind.TORCH, ReaderKind.HOST)
    return (ReaderKind.HOST,)


def select_reader(device: torch.device | str, *, activation_bytes_fn: ActivationBytesFn | None = None,
                  prefer_nvml: bool = True) -> MemoryReader:
    """The best reader that works for ``device``.

    A CUDA device gets :class:`~memctl.monitor.NvmlReader` when NVML initialises, else
    :class:`~memctl.monitor.TorchAllocatorReader`, else the host reader; any other device
    (CPU, MPS, ...) gets :class:`~memctl.monitor.HostReader`. Failures along the way give
    one ``RuntimeWarning`` and never an exception (``NOTE [ Readers degrade, never raise ]``).

    Raises:
        ConfigError: ``device`` is not a PyTorch device.
    """
    chain = reader_chain(device, prefer_nvml=prefer_nvml)
    reader, failures = _first_working(chain, device, activation_bytes_fn)
    if failures:
        warnings.warn(
            f"memctl monitor: {'; '.join(failures)}; reading {reader.device} with the "
            f"{reader.name.value!r} reader instead",
            RuntimeWarning,
            stacklevel=2,
        )
    return reader


def fallback_reader(failed: MemoryReader, reason: str) -> tuple[MemoryReader | None, str]:
    """The next reader after ``failed`` in its device's chain, and a message saying so.

    ``failed`` is closed. Returns ``(None, message)`` when no reader is left.
    """
    with contextlib.suppress(Exception):  # closing a broken reader may fail too; it is dropped anyway
        failed.close()
    chain = reader_chain(failed.device)
    rest = chain[chain.index(failed.name) + 1:] if failed.name in chain else ()
    failures = [f"the {failed.name.value!r} reader for {failed.device} failed: {reason}"]
    if not rest:
        return None, "; ".join(failures) + "; memory monitoring is off"
    reader, more = _first_working(rest, failed.device, failed.activation_bytes_fn)
    failures.extend(more)
    return reader, "; ".join(failures) + f"; switched to the {reader.name.value!r} reader"


def _first_working(chain: Sequence[ReaderKind], device: torch.device | str,
                   fn: ActivationBytesFn | None) -> tuple[MemoryReader, list[str]]:
    failures: list[str] = []
    for kind in chain:
        if kind is ReaderKind.HOST:
            break
        try:
            if kind is ReaderKind.NVML:
                from memctl.monitor.nvml import NvmlReader

                return NvmlReader(device, fn), failures
            return TorchAllocatorReader(device, fn), failures
        except Exception as exc:
            failures.append(f"the {kind.value!r} reader for {device} is unavailable ({_describe(exc)})")
    return HostReader(fn), failures


def _describe(exc: BaseException) -> str:
    text = str(exc) or "no message"
    return f"{type(exc).__name__}: {text}"


def _is_cuda(device: torch.device | str) -> bool:
    import torch

    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"device {device!r} is not a PyTorch device ({exc}); expected e.g. 'cpu', 'cuda' or 'cuda:0'"
        ) from None

