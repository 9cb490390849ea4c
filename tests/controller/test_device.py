"""The device check: a GPU this machine lacks is a ConfigError that says so, before any hook."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memctl
from memctl.controller.device import resolve_device


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_without_a_gpu_is_a_config_error(device: object) -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(memctl.ConfigError, match="there is no GPU") as info:
        memctl.Controller(model, device=device, monitor_interval_s=0)  # type: ignore[arg-type]
    assert "device='cpu'" in str(info.value)
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("device", ["graphics", "cuda:x", 3])
def test_a_bad_device_name_is_a_config_error(device: object) -> None:
    with pytest.raises(memctl.ConfigError, match="device="):
        resolve_device(device, nn.Linear(2, 2))  # type: ignore[arg-type]


def test_none_and_cpu_resolve() -> None:
    model = nn.Linear(2, 2)
    assert resolve_device(None, model) == torch.device("cpu")
    assert resolve_device("cpu", model) == torch.device("cpu")
