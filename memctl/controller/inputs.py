"""The model's own inputs, saved by reference instead of compressed.

NOTE [ Model inputs ]
The first layer saves the tensor the model was called with (an image batch): compressing
it gives no memory back while the caller still holds the batch, which a training loop does
until its next iteration (``for x, y in loader: loss = f(model(x), y) ...``); the
compressed copy is then held *besides* the original. Its error is not cheap either: the
first layer's weight gradient is that input times the gradient at its output, summed over
every position, and at 2 bits its quantisation noise was as large as the gradient itself
on the conv nets of ``benchmarks/activations.py`` (relative error about 1 on the first
convolution's weight gradient, the largest error term of the whole model).

With ``keep_inputs=True`` (off by default), a float tensor saved while the model's
forward runs, which is one of the forward's arguments (or shares its storage: a view of
one), has no ``grad_fn`` and needs no gradient, is kept as a reference, as plain PyTorch
keeps it, with autograd's in-place check (NOTE [ In-place checks ] in versions.py). Like
a parameter it is memory the caller owns: it is counted as saved as it is (``passed``),
not in the layer's raw or packed bytes. An input that needs a gradient (adversarial
training) or is computed inside the forward (a normalisation, a ``.float()``) is not the
caller's tensor and is compressed as before. What it costs: when the caller drops the
batch before the backward (a batch built by ``model(x.to(device))`` and nothing else),
memctl holds it whole, as plain PyTorch does.

Why it is off by default: ``benchmarks/fidelity.py`` counts memctl's records from the
outside, and there the kept image counts whole (ResNet-18 at 64x64: 11.0x instead of
15.3x at ``bits=2``, although the process holds less); and the calibration's per-width
factor for unmeasured layers moved with it (ResNet-18's default policy kept 4 bits
almost everywhere, 8.1x instead of 11.3x, over 20 steps in which one layer was
measured): the closed-form shares of the other layers rose about 40x once the first
convolution, whose share had dominated, no longer had a record. Turning it on by
default waits for that estimator not to depend on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ModelInputs"]


class ModelInputs:
    """Storages of the tensors the model's current top-level forward was called with."""

    def __init__(self) -> None:
        self._ptrs: set[int] = set()

    def set(self, values: Iterable[Any]) -> None:
        """The forward's arguments (tensors, and tensors inside tuples, lists and dicts)."""
        self._ptrs = {t.untyped_storage().data_ptr() for t in _tensors(values, 3)
                      if t.is_floating_point() and not t.requires_grad and t.layout == torch.strided}
        self._ptrs.discard(0)

    def clear(self) -> None:
        self._ptrs = set()

    def holds(self, t: torch.Tensor, ptr: int) -> bool:
        """``t`` (whose storage is at ``ptr``) is one of the forward's own inputs (NOTE [ Model inputs ])."""
        return bool(self._ptrs) and ptr in self._ptrs and t.grad_fn is None and not t.requires_grad


def _tensors(values: Iterable[Any], depth: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif depth > 0 and isinstance(v, tuple | list):
            out += _tensors(v, depth - 1)
        elif depth > 0 and isinstance(v, dict):
            out += _tensors(v.values(), depth - 1)
    return out
