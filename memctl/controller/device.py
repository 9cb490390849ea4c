"""The device a controller's budget is about, checked before anything touches it."""

from __future__ import annotations

import torch

from memctl.controller import memory
from memctl.errors import ConfigError

__all__ = ["resolve_device"]


def resolve_device(device: torch.device | str | None, model: torch.nn.Module) -> torch.device:
    """``device`` as a ``torch.device`` (the model's when ``None``), checked to exist here.

    Raises:
        ConfigError: ``device`` is not a device name, or names a GPU this machine lacks
            (a CPU-only PyTorch build, no visible GPU, or an index past the last GPU).
    """
    if device is None:
        return memory.model_device(model)
    if not isinstance(device, torch.device | str):
        raise ConfigError(
            f"device={device!r} must be a torch.device, a string such as 'cuda:0' or 'cpu', or None "
            "(the model's device)"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"device={device!r} is not a device name ({exc}); use 'cpu', 'cuda' or 'cuda:N'") \
            from None
    if dev.type != "cuda":
        return dev
    if torch.version.cuda is None and torch.version.hip is None:
        raise ConfigError(
            f"device={device!r}, but there is no GPU: this PyTorch build has no CUDA support "
            f"(torch {torch.__version__}). Use device='cpu', or install a CUDA build of PyTorch"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device={device!r}, but there is no GPU: torch.cuda.is_available() is False (no device "
            "visible, or the driver is missing). Use device='cpu', or check CUDA_VISIBLE_DEVICES "
            "and the driver"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ConfigError(
            f"device={device!r}, but this machine has {count} GPU(s) (cuda:0..cuda:{count - 1}); "
            "pick one of those"
        )
    return dev
