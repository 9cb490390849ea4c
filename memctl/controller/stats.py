"""Per-layer statistics: what one step saved, and the smoothed sensitivity across steps.

NOTE [ Sensitivity ]
For a layer whose weight gradient is ∇W = ∇Yᵀ X, stochastic rounding of X's groups to b
bits (B = 2^b − 1 levels, per-value variance at most (R_g/B)²/4) adds about

    Var ≈ (1/B²) · (k/4) · Σ_n ‖∇Y_n‖² · Σ_{g in sample n} G · R_g²

to the gradient (ActNN, ICML 2021; k kernel locations, G group size). Per-sample products
are not observable without per-sample gradients, so we take Σ_n a_n b_n ≈ (Σ a)(Σ b)/N:

    C_l = (k/4) · ‖∇Y‖² · G · Σ_g R_g² / N

with ‖∇Y‖² from a hook on the module's output gradient and Σ_g R_g² from the quantiser's
own group metadata, each smoothed by an EMA over steps. A layer whose output gradient is
not observed (a functional op at the root, the loss) borrows the median ‖∇Y‖² of the rest.
See docs/design.md, "Sensitivity".
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LayerState", "LayerStep", "median_grad_sq", "read_scalars"]


@dataclass
class LayerStep:
    """What one layer saved during one step (accumulated by the pack hook)."""

    raw_bytes: int = 0
    """Raw bytes of every float activation the layer saved."""
    packed_bytes: int = 0
    """Bytes those activations held after packing."""
    numels: list[int] = field(default_factory=list)
    """Sizes of the float tensors the allocation controls (compressed or kept)."""
    fixed_bytes: int = 0
    """Bytes the allocation does not control: small tensors, codec fallbacks."""
    floored_bytes: int = 0
    """Bytes of tensors held at a bit floor (NOTE [ Bit floors ]), part of ``fixed_bytes``."""
    mask_bytes: int = 0
    """Bytes of the 1-bit ReLU masks its controlled tensors need when compressed."""
    bit_values: float = 0.0
    """Σ bits × values over the controlled tensors, at the bits they were saved with."""
    other_bytes: int = 0
    """Bytes of non-float saved tensors (kept lossless)."""
    tensors: int = 0
    # scalar tensors, or floats where the value was already on the host (NOTE [ One read-back per step ])
    range_terms: list[torch.Tensor | float] = field(default_factory=list)
    mins: list[torch.Tensor | float] = field(default_factory=list)
    maxs: list[torch.Tensor | float] = field(default_factory=list)
    grad_sq: list[torch.Tensor | float] = field(default_factory=list)
    element_size: int = 4

    @property
    def controlled_raw_bytes(self) -> int:
        return sum(self.numels) * self.element_size


@dataclass
class LayerState:
    """Everything the controller keeps about one layer across steps."""

    name: str
    kernel: int = 1
    bits: float | None = None
    error_bound: float | None = None
    ema_grad_sq: float | None = None
    ema_range_term: float | None = None
    raw_bytes: int = 0
    packed_bytes: int = 0
    fixed_bytes: int = 0
    floored_bytes: int = 0
    mask_bytes: int = 0
    other_bytes: int = 0
    numels: tuple[int, ...] = ()
    element_size: int = 4
    batch: int = 1
    vmin: float | None = None
    vmax: float | None = None
    used_bits: float | None = None
    seen_steps: int = 0

    def update(
        self, step: LayerStep, *, batch: int, decay: float, scalars: tuple[float, ...] | None = None
    ) -> None:
        """Fold one finished step into the layer's state.

        ``scalars``: ``step``'s row of :func:`read_scalars`, when the caller read every layer's
        device scalars at once; otherwise they are read here.
        """
        self.raw_bytes = step.raw_bytes
        self.packed_bytes = step.packed_bytes
        self.fixed_bytes = step.fixed_bytes
        self.floored_bytes = step.floored_bytes
        self.mask_bytes = step.mask_bytes
        self.other_bytes = step.other_bytes
        self.numels = tuple(step.numels)
        self.element_size = step.element_size
        self.batch = max(batch, 1)
        self.seen_steps += 1
        total = sum(step.numels)
        self.used_bits = step.bit_values / total if total else None
        vmin, vmax, range_sum, g2 = read_scalars([step])[0] if scalars is None else scalars
        if step.mins:
            self.vmin, self.vmax = vmin, vmax
        if step.range_terms:
            self.ema_range_term = _ema(self.ema_range_term, range_sum / self.batch, decay)
        if step.grad_sq and math.isfinite(g2):
            self.ema_grad_sq = _ema(self.ema_grad_sq, g2, decay)

    def sensitivity(self, fallback_grad_sq: float) -> float:
        """C_l of NOTE [ Sensitivity ] (0 when the layer saved nothing quantisable)."""
        if self.ema_range_term is None:
            return 0.0
        g2 = self.ema_grad_sq if self.ema_grad_sq is not None else fallback_grad_sq
        return self.kernel / 4.0 * g2 * self.ema_range_term

    def state_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_state_dict(cls, sd: dict[str, Any]) -> LayerState:
        sd = dict(sd)
        sd["numels"] = tuple(sd.get("numels", ()))
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in sd.items() if k in known})


def median_grad_sq(layers: list[LayerState]) -> float:
    """Median smoothed ‖∇Y‖² over layers that observed one (1.0 when none did)."""
    seen = [s.ema_grad_sq for s in layers if s.ema_grad_sq is not None and s.ema_grad_sq > 0]
    return statistics.median(seen) if seen else 1.0


def read_scalars(steps: list[LayerStep]) -> list[tuple[float, float, float, float]]:
    """Each step's ``(min, max, Σ range terms, Σ ‖∇Y‖²)`` as floats (NaN where its list is empty).

    NOTE [ One read-back per step ]
    The statistics are device scalars, several per layer. Reading each with ``float()`` waits
    for the device once per scalar: ~80 waits per step on a 20-layer CNN, each one draining
    the GPU's queue. Here every layer's four values are reduced on their device and stacked,
    and each device is read back once (one ``tolist``).
    A CPU value waits for nothing, and a torch reduction over a few scalars costs ~5 µs an
    op where Python's costs well under one: values on the CPU (or already floats) are read
    and reduced on the host, ~20 µs a layer less at every step boundary.
    """
    rows: list[list[float]] = [[math.nan] * 4 for _ in steps]
    by_device: dict[torch.device, list[tuple[int, int, torch.Tensor]]] = {}
    for i, step in enumerate(steps):
        parts = (
            (0, step.mins, torch.float32, torch.min, min), (1, step.maxs, torch.float32, torch.max, max),
            (2, step.range_terms, torch.float64, torch.sum, math.fsum),
            (3, step.grad_sq, torch.float64, torch.sum, math.fsum),
        )
        for column, values, dtype, reduce, reduce_host in parts:
            if not values:
                continue
            host = _on_host(values)
            if host is not None:  # NaN wherever it is, as torch's reductions give it
                rows[i][column] = math.nan if any(v != v for v in host) else reduce_host(host)
                continue
            value = reduce(_fold(values, dtype)).double()
            by_device.setdefault(value.device, []).append((i, column, value))
    for entries in by_device.values():
        for (i, column, _), value in zip(entries, torch.stack([e[2] for e in entries]).tolist(), strict=True):
            rows[i][column] = value
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def _on_host(values: list[torch.Tensor | float]) -> list[float] | None:
    """``values`` as floats when every one is a float or a CPU tensor, else None."""
    out = []
    for v in values:
        if type(v) is float:
            out.append(v)
        elif isinstance(v, torch.Tensor) and v.device.type == "cpu":
            out.append(float(v))
        else:
            return None
    return out


def _fold(values: list[torch.Tensor | float], dtype: torch.dtype) -> torch.Tensor:
    """``values`` (scalar tensors, and floats) as one tensor of ``dtype``, to reduce in one read."""
    device = next(v.device for v in values if isinstance(v, torch.Tensor))
    tensors = [v.to(dtype) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=dtype, device=device)
               for v in values]
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors)


def _ema(old: float | None, new: float, decay: float) -> float:
    if old is None or not math.isfinite(old):
        return new
    return decay * old + (1.0 - decay) * new
