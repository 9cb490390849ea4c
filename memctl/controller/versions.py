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
error is the ``RuntimeError`` plain PyTorch raises, with its wording. That wording moves
between releases (torch 2.13 names the node ``AsStrided`` and hints at
``set_detect_anomaly(True, check_nan=False)``; earlier ones name it ``AsStridedBackward0``
and hint at ``set_detect_anomaly(True)``), so the node's spelling and the hint are read once
from an error the installed PyTorch raises itself (:func:`autograd_wording`).
"""

from __future__ import annotations

import functools
import re
import warnings

import torch

__all__ = ["SavedRef", "autograd_wording", "check_version"]

_BACKWARD = re.compile(r"Backward\d*$")


class SavedRef:
    """A tensor saved as it is (a parameter, or a tensor saved outside the capture window)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        tensor = self.tensor
        if tensor._version != self.version:  # (check_version raises; tested here first: every parameter)
            check_version(tensor, self.version)
        return tensor


def check_version(tensor: torch.Tensor, saved_version: int, node: tuple[str, int] | None = None) -> None:
    """Raise autograd's in-place error if ``tensor`` changed since it was saved; ``node``: the name
    and output number of the op that made it, for a detached ``tensor`` (autograd names the op)."""
    current = tensor._version
    if current == saved_version:
        return
    suffix, hints = autograd_wording()
    grad_fn = tensor.grad_fn
    which = ""
    if grad_fn is not None:
        node = (grad_fn.name(), int(tensor.output_nr))
    if node is not None:
        name = node[0] if suffix else _BACKWARD.sub("", node[0])
        which = f", which is output {node[1]} of {name},"
    hint = hints[torch.is_anomaly_enabled()]
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{tensor.type()} {list(tensor.shape)}]{which} is at version {current}; "
        f"expected version {saved_version} instead.{hint}"
    )


_HINTS = (
    " Hint: enable anomaly detection to find the operation that failed to compute its "
    "gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False).",
    " Hint: the backtrace further above shows the operation that failed to compute its "
    "gradient. The variable in question was changed in there or anywhere later. Good luck!",
)


@functools.cache
def autograd_wording() -> tuple[bool, tuple[str, str]]:
    """``(whether the node keeps its "Backward0" suffix, (hint, hint in anomaly mode))`` as the
    installed PyTorch words its in-place error (NOTE [ In-place checks ]); torch 2.13's wording
    when no error can be provoked here."""
    suffix = False
    hints = list(_HINTS)
    for anomaly in (False, True):
        text = _provoke(anomaly)
        if text is None:
            continue
        if anomaly is False:
            match = re.search(r"which is output 0 of ([A-Za-z0-9_]+),", text)
            suffix = bool(match and _BACKWARD.search(match.group(1)))
        start = text.find("instead.")
        if start >= 0:
            hints[anomaly] = text[start + len("instead."):].split("\n")[0].rstrip()
    return suffix, (hints[0], hints[1])


def _provoke(anomaly: bool) -> str | None:
    """The message of a real in-place error, raised by autograd without saved-tensor hooks."""
    try:
        with torch.enable_grad(), torch.autograd.graph.disable_saved_tensors_hooks("memctl probe"), \
                warnings.catch_warnings(), torch.autograd.set_detect_anomaly(anomaly):
            warnings.simplefilter("ignore")
            a = torch.ones(2, requires_grad=True)
            b = a.exp()  # saves its result
            with torch.no_grad():
                b.add_(1.0)
            b.sum().backward()
    except RuntimeError as exc:
        text = str(exc)
        return text if "modified by an inplace operation" in text else None
    return None
