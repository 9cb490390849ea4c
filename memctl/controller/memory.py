"""Memory accounting for the budget policy: device totals and static memory.

NOTE [ Static memory ]
The budget is a device-memory target T. What is not activations (parameters, gradients,
optimizer state, allocator workspace) is static memory S, and the activation budget is
A = T − S − margin (docs/design.md, "Terms"). S is measured at each step boundary from the tensors
themselves — parameters, their gradients, buffers and the optimizer's state, each
storage counted once — which works the same on the CPU (the process's own accounting)
and on a GPU. On a GPU the allocator's peak of the step is read as well; whatever it
held beyond those tensors and the saved activations is workspace, added to S. The peak
counter is reset at every step boundary.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from memctl.controller.fsdp import local_tensor

__all__ = ["device_total_bytes", "model_device", "static_bytes", "tensor_bytes"]


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for an empty model)."""
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def device_total_bytes(device: torch.device) -> int | None:
    """Total memory of ``device``: the GPU's, or the host's physical memory for the CPU."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _strided(tensors: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    """``tensors``, a sparse one (``nn.Embedding(sparse=True)``'s gradient, which has no storage
    to read) as its index and value tensors; one of another layout is left out."""
    for t in tensors:
        if t.layout == torch.strided:
            yield t
        elif t.layout == torch.sparse_coo:
            yield from (t._indices(), t._values())
        elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
            yield from (t.crow_indices(), t.col_indices(), t.values())
        elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
            yield from (t.ccol_indices(), t.row_indices(), t.values())


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in _strided(tensors):
        if t.device.type == "meta":
            continue
        storage = local_tensor(t).untyped_storage()  # a DTensor's own storage cannot be read
        key = (str(t.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def static_bytes(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    saved_bytes: int,
) -> int:
    """Static memory S of NOTE [ Static memory ], in bytes."""

    def tensors() -> Iterator[torch.Tensor]:
        for p in model.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from model.buffers()
        if optimizer is not None:
            for state in optimizer.state.values():
                yield from _iter_tensors(state)

    held = tensor_bytes(tensors())
    if device.type != "cuda":
        return held
    peak = int(torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)
    workspace = max(0, peak - held - saved_bytes)
    return held + workspace


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _iter_tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _iter_tensors(v)
