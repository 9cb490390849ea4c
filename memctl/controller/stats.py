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

NOTE [ Sparse gradient statistics ]
‖∇Y‖² is read only on the steps whose statistics the next allocation uses (the controller's
``_wants_gradients``: the first two, and the last and first step around each re-solve), two
readings in ``allocation_interval`` steps. An EMA of ``ema_decay`` (0.9) per *reading* then
remembered ~50 steps: after 20 steps, with readings at steps 0, 1, 9, 10 and 19, the first
step's ‖∇Y‖² still weighed 0.66 in it, and a gradient that fell 10⁴-fold over those steps
(ResNet-18 of ``benchmarks/fidelity.py``) left the closed form three orders of magnitude high.
The decay now runs per step seen: a reading ``gap`` steps after the last one weighs the old
value by ``ema_decay ** gap`` (the first step's weight at step 20: 0.14), as a reading every
step would. The calibrated model leans on this for every layer not yet measured (NOTE [
Unmeasured layers ]), whose estimate is the closed form times a factor fitted at a probe,
and for its drift between probes (NOTE [ Calibration ]).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
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
    small_bytes: int = 0
    """Bytes of float tensors kept as they are for having fewer than ``min_numel`` values,
    part of ``fixed_bytes`` (NOTE [ Small tensors kept as they are ] in controller.py)."""
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
    grad_step: int = 0
    """``seen_steps`` when ``ema_grad_sq`` was last updated (NOTE [ Sparse gradient statistics ])."""

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
            # NOTE [ Sparse gradient statistics ]: the decay runs per step, not per reading
            gap = max(self.seen_steps - self.grad_step, 1)
            self.ema_grad_sq = _ema(self.ema_grad_sq, g2, decay ** gap)
            self.grad_step = self.seen_steps

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
    the GPU's queue. Here every device scalar of every layer is stacked (one stack per dtype),
    each device is read back once (one ``tolist``), and the lists are reduced on the host.
    Until 2026-11-27 each layer's four lists were first reduced on the device, four or five
    ops a list: on an H200 the CNN of benchmarks/training.py spent 117 of memctl's 742 ops a
    step there, each a launch of ~10 µs of CPU.
    A CPU value waits for nothing, and a torch reduction over a few scalars costs ~5 µs an
    op where Python's costs well under one: values on the CPU (or already floats) are read
    and reduced on the host, ~20 µs a layer less at every step boundary.
    """
    rows: list[list[float]] = [[math.nan] * 4 for _ in steps]
    by_device: dict[torch.device, list[tuple[int, int, list[torch.Tensor | float]]]] = {}
    reducers = (min, max, math.fsum, math.fsum)
    for i, step in enumerate(steps):
        for column, values in enumerate((step.mins, step.maxs, step.range_terms, step.grad_sq)):
            if not values:
                continue
            host = _on_host(values)
            if host is None:
                device = next(v.device for v in values if isinstance(v, torch.Tensor))
                by_device.setdefault(device, []).append((i, column, values))
                continue
            rows[i][column] = _reduce(host, reducers[column])
    for entries in by_device.values():
        for (i, column, _), host in zip(entries, read_back([e[2] for e in entries]), strict=True):
            rows[i][column] = _reduce(host, reducers[column])
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def _reduce(values: list[float], reduce: Callable[[list[float]], float]) -> float:
    """``reduce(values)``, NaN when any value is NaN, as torch's reductions give it."""
    return math.nan if any(map(math.isnan, values)) else float(reduce(values))


def read_back(lists: list[list[torch.Tensor | float]]) -> list[list[float]]:
    """``lists`` of floats and one-value tensors of one device as floats, read back with one
    copy (NOTE [ One read-back per step ]): the tensors stacked by dtype, as float64."""
    flat = [v for values in lists for v in values if isinstance(v, torch.Tensor)]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for j, t in enumerate(flat):
        by_dtype.setdefault(t.dtype, []).append(j)
    parts: list[torch.Tensor] = []
    order: list[int] = []
    for dtype, index in by_dtype.items():
        stacked = torch.stack([flat[j] if flat[j].dim() == 0 else flat[j].reshape(()) for j in index])
        parts.append(stacked if dtype is torch.float64 else stacked.double())
        order.extend(index)
    read = [] if not parts else (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    by_place = [0.0] * len(flat)
    for j, value in zip(order, read, strict=True):
        by_place[j] = value
    out: list[list[float]] = []
    k = 0
    for values in lists:
        row = []
        for v in values:
            if isinstance(v, torch.Tensor):
                row.append(by_place[k])
                k += 1
            else:
                row.append(float(v))
        out.append(row)
    return out


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


def _ema(old: float | None, new: float, decay: float) -> float:
    if old is None or not math.isfinite(old):
        return new
    return decay * old + (1.0 - decay) * new
