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

With ``keep_inputs=True`` (the default), a tensor saved while the model's forward runs,
which is one of the forward's arguments (or shares its storage: a view of one), has no
``grad_fn`` and needs no gradient, is kept as a reference, as plain PyTorch keeps it, with
autograd's in-place check (NOTE [ In-place checks ] in versions.py). Images and features
for their noise; token ids, masks and labels because a lossless copy of a tensor the
caller holds only adds memory. Like a parameter it is memory the caller owns: it is
counted as saved as it is (``passed``), not in the layer's raw or packed bytes. An input
that needs a gradient (adversarial training) or is computed inside the forward (a
normalisation) is not the caller's tensor and is compressed as before; a cast of a float
input (autocast's bfloat16 copy, a half input's ``.float()``) is held as well (NOTE [ Copies
of parameters without a node ] in copies.py).
What it costs: when the caller drops the batch before the backward (a batch built by
``model(x.to(device))`` and nothing else), memctl holds it whole, as plain PyTorch does;
``keep_inputs=False`` compresses it instead, at the noise above.

It was off by default until the calibration measured enough layers early. With the image
kept, the closed forms the per-width factor of unmeasured layers is spread over (NOTE [
Unmeasured layers ] in calibration.py) lose the first convolution, which had dominated
them, and the factor rose ~40x: when a probe measured one layer, ResNet-18's default policy
kept 4 bits almost everywhere over 20 steps (8.1x instead of 11.3x). Since each probe
measures at least as many unmeasured layers as it has fixed replays (NOTE [ Probe cost ]),
its default row is 11.0x, and on the digits of ``memctl demo`` over 300 steps ``bits=2``
went from +40% / -8% / +6% of plain's validation loss (seeds 0, 1, 2) to -3.4% / -0.3% /
-0.2%. What is left of it: on ViT-Tiny (49 layers, 7 measured by the first probe) the image
had held 96% of the unmeasured closed forms and diluted every other layer's share 24x, too
low by a median 5x at 2 bits; without it the share is too high (a median 7x), and the
default policy compresses 6.8x instead of 9.1x until later probes measure more layers
(benchmarks/README.md, ``fidelity.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ModelInputs"]


class ModelInputs:
    """Storages of the tensors the model's current top-level forward was called with."""

    def __init__(self) -> None:
        self.ptrs: set[int] = set()
        """Their storages' data pointers (the pack hook tests membership before :meth:`holds`)."""
        self.floats: list[torch.Tensor] = []
        """The float ones among them, whose casts are held too (NOTE [ Copies of parameters
        without a node ] in copies.py)."""

    def set(self, values: Iterable[Any]) -> None:
        """The forward's arguments (tensors, and tensors inside tuples, lists and dicts)."""
        mine = [t for t in _tensors(values, 3) if not t.requires_grad and t.layout == torch.strided]
        self.ptrs = {t.untyped_storage().data_ptr() for t in mine}
        self.ptrs.discard(0)
        self.floats = [t for t in mine if t.is_floating_point()]

    def clear(self) -> None:
        self.ptrs = set()
        self.floats = []

    def holds(self, t: torch.Tensor, ptr: int) -> bool:
        """``t`` (whose storage is at ``ptr``) is one of the forward's own inputs (NOTE [ Model inputs ])."""
        return ptr in self.ptrs and t.grad_fn is None and not t.requires_grad


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
