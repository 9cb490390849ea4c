"""Autograd's in-place check, done by the pack/unpack pair itself.

NOTE [ In-place checks ]
Autograd compares a saved tensor's version counter at unpack with the one it had when
it was saved, and raises "one of the variables needed for gradient computation has
been modified by an inplace operation" when they differ. With saved-tensor hooks
installed it skips that check (it cannot see through the hooks), so a weight changed
between forward and backward, or ``backward(retain_graph=True); opt.step();
backward()``, would silently use the changed weight. memctl therefore records
``t._version`` when it packs a tensor and compares at unpack: a parameter (passed
through, not copied) is checked always; a compressed activation is checked while the
tensor it came from is alive (once that tensor is gone, nothing can modify it). The
error is the ``RuntimeError`` plain PyTorch raises, with its wording.
"""

from __future__ import annotations

import re

import torch

__all__ = ["SavedRef", "check_version"]

_BACKWARD = re.compile(r"Backward\d*$")


class SavedRef:
    """A tensor saved as it is (a parameter, or a tensor saved outside the capture window)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        check_version(self.tensor, self.version)
        return self.tensor


def check_version(tensor: torch.Tensor, saved_version: int) -> None:
    """Raise autograd's in-place error if ``tensor`` changed since it was saved."""
    current = tensor._version
    if current == saved_version:
        return
    grad_fn = tensor.grad_fn
    # autograd's message names the node without its "Backward0" suffix ("Exp", "AsStrided")
    which = f", which is output {tensor.output_nr} of {_BACKWARD.sub('', grad_fn.name())}," if grad_fn else ""
    if torch.is_anomaly_enabled():
        hint = ("Hint: the backtrace further above shows the operation that failed to compute its "
                "gradient. The variable in question was changed in there or anywhere later. Good luck!")
    else:
        hint = ("Hint: enable anomaly detection to find the operation that failed to compute its "
                "gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False).")
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{tensor.type()} {list(tensor.shape)}]{which} is at version {current}; "
        f"expected version {saved_version} instead. {hint}"
    )
