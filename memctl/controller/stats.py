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
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LayerState", "LayerStep", "ScalarRead", "grad_sq_names", "median_grad_sq", "read_scalars",
           "start_read"]


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
    raised_values: int = 0
    """Values of its records stored at twice the layer's bits: a value-dependent op's input
    whose output no record holds (NOTE [ Outputs recomputed from the input ] in derived.py;
    NOTE [ Widths a record is stored at ] in calibration.py)."""
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
    ranged: bool = True
    """Whether its records keep range statistics (NOTE [ Range statistics on the steps that
    gather statistics ] in packing.py)."""

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
    range_step: int = 0
    """``seen_steps`` when ``ema_range_term`` was last updated."""

    def update(
        self, step: LayerStep, *, batch: int, decay: float, scalars: tuple[float, ...] | None = None,
        later: bool = False,
    ) -> None:
        """Fold one finished step into the layer's state.

        ``scalars``: ``step``'s row of :func:`read_scalars`, when the caller read every layer's
        device scalars at once; otherwise they are read here. ``later``: neither; the caller
        folds the row with :meth:`fold` before the next update (NOTE [ Statistics read a step
        late ]).
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
        if not later:
            self.fold(step, read_scalars([step])[0] if scalars is None else scalars, decay=decay)

    def fold(self, step: LayerStep, scalars: tuple[float, ...], *, decay: float) -> None:
        """Fold ``step``'s row of :func:`read_scalars` into the smoothed statistics: part of
        :meth:`update`, or after it, before the next update (NOTE [ Statistics read a step late ])."""
        vmin, vmax, range_sum, g2 = scalars
        if step.mins:
            self.vmin, self.vmax = vmin, vmax
        # both read on the steps that gather statistics only (NOTE [ Sparse gradient statistics ]):
        # their decay runs per step seen, not per reading
        if step.range_terms:
            self.ema_range_term = self._per_step(self.ema_range_term, range_sum / self.batch, decay,
                                                 self.range_step)
            self.range_step = self.seen_steps
        if step.grad_sq and math.isfinite(g2):
            self.ema_grad_sq = self._per_step(self.ema_grad_sq, g2, decay, self.grad_step)
            self.grad_step = self.seen_steps

    def _per_step(self, old: float | None, value: float, decay: float, last: int) -> float:
        """``_ema`` decayed once per step seen since ``last`` (at least once)."""
        return _ema(old, value, decay ** max(self.seen_steps - last, 1))

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


def median_grad_sq(layers: list[LayerState], among: Collection[str] | None = None) -> float:
    """Median smoothed ‖∇Y‖² over layers that observed one (1.0 when none did); with ``among``,
    over those of its layers that did, where any did (NOTE [ The median's layers ] in
    calibration.py)."""
    seen = [g2 for name, g2 in _grad_sqs(layers) if among is None or name in among]
    if not seen and among is not None:
        return median_grad_sq(layers)
    return statistics.median(seen) if seen else 1.0


def grad_sq_names(layers: list[LayerState]) -> frozenset[str]:
    """The layers :func:`median_grad_sq` takes its median over, without ``among``."""
    return frozenset(name for name, _ in _grad_sqs(layers))


def _grad_sqs(layers: list[LayerState]) -> list[tuple[str, float]]:
    """``(name, smoothed ‖∇Y‖²)`` of the layers that observed a positive one."""
    return [(s.name, s.ema_grad_sq) for s in layers if s.ema_grad_sq is not None and s.ema_grad_sq > 0]


def read_scalars(steps: list[LayerStep]) -> list[tuple[float, float, float, float]]:
    """Each step's ``(min, max, Σ range terms, Σ ‖∇Y‖²)`` as floats (NaN where its list is empty):
    :func:`start_read` and its result at once."""
    return start_read(steps).result()


_REDUCERS: tuple[Callable[[list[float]], float], ...] = (min, max, math.fsum, math.fsum)


def start_read(steps: list[LayerStep], *, defer: bool = False) -> ScalarRead:
    """Start reading each step's ``(min, max, Σ range terms, Σ ‖∇Y‖²)`` back; ``result()`` gives
    the rows (NaN where a list is empty).

    NOTE [ One read-back per step ]
    The statistics are device scalars, several per layer. Reading each with ``float()`` waits
    for the device once per scalar: ~80 waits per step on a 20-layer CNN, each one draining
    the GPU's queue. Here every device scalar of every layer is stacked (one stack per dtype),
    each device is read back once (one copy), and the lists are reduced on the host.
    Until 2026-11-27 each layer's four lists were first reduced on the device, four or five
    ops a list: on an H200 the CNN of benchmarks/training.py spent 117 of memctl's 742 ops a
    step there, each a launch of ~10 µs of CPU.
    A CPU value waits for nothing, and a torch reduction over a few scalars costs ~5 µs an
    op where Python's costs well under one: values on the CPU (or already floats) are read
    and reduced on the host, ~20 µs a layer less at every step boundary.

    NOTE [ Statistics read a step late ]
    Even one read-back a step waits for the GPU to finish the step's backward: the CPU then
    starts the next step with the GPU's queue empty, and a step takes the CPU's time plus
    part of the GPU's rather than the larger of the two (on an H200 the CNN of
    benchmarks/training.py waited 6.3 ms a step there, 2026-11-28). With ``defer`` a CUDA
    device's scalars are copied into pinned host memory behind an event instead, and
    ``result()`` waits for that event: the controller folds a step's statistics at the next
    step boundary, a step later, when the copy has long passed. It folds them at once where
    they are used in the same boundary (a calibration probe, the convergence guard, an
    allocation, any boundary under a process group), and before a read in the training
    thread (``stats()``, ``state_dict()``, ``detach()``); a snapshot published at the
    boundary itself shows the previous step's minima, maxima and sensitivities (NOTE [ Lazy
    publication ]). Nothing else reads them, so the run is the same to the bit as with the
    read at once (``test_statistics_folded_a_step_late_change_nothing``). On the CPU the
    values are read at once: there is no queue to drain.
    """
    rows: list[list[float]] = [[math.nan] * 4 for _ in steps]
    by_device: dict[torch.device, list[tuple[int, int, list[torch.Tensor | float]]]] = {}
    for i, step in enumerate(steps):
        for column, values in enumerate((step.mins, step.maxs, step.range_terms, step.grad_sq)):
            if not values:
                continue
            host = _on_host(values)
            if host is None:
                device = next(v.device for v in values if isinstance(v, torch.Tensor))
                by_device.setdefault(device, []).append((i, column, values))
                continue
            rows[i][column] = _reduce(host, _REDUCERS[column])
    reads = [(entries, _Copy([e[2] for e in entries], defer and device.type == "cuda"))
             for device, entries in by_device.items()]
    return ScalarRead(rows, reads)


class ScalarRead:
    """Rows of :func:`start_read`, their device part possibly still on its way to the host."""

    __slots__ = ("_reads", "_rows")

    def __init__(self, rows: list[list[float]],
                 reads: list[tuple[list[tuple[int, int, list[torch.Tensor | float]]], _Copy]]) -> None:
        self._rows = rows
        self._reads = reads

    def done(self) -> bool:
        """Whether :meth:`result` would wait for nothing."""
        return all(copy.done() for _, copy in self._reads)

    def result(self) -> list[tuple[float, float, float, float]]:
        """The rows, waiting for the device copies that have not arrived."""
        rows = self._rows
        for entries, copy in self._reads:
            for (i, column, _), host in zip(entries, copy.lists(), strict=True):
                rows[i][column] = _reduce(host, _REDUCERS[column])
        self._reads = []
        return [(r[0], r[1], r[2], r[3]) for r in rows]


class _Copy:
    """``lists`` of floats and one-value tensors of one device, on their way to the host as one
    float64 vector (NOTE [ One read-back per step ]): the tensors stacked by dtype. ``defer``
    (a CUDA device): copied into pinned memory behind an event (NOTE [ Statistics read a step
    late ]); otherwise read back here."""

    __slots__ = ("_event", "_host", "_lists", "_order")

    def __init__(self, lists: list[list[torch.Tensor | float]], defer: bool) -> None:
        self._lists = lists
        flat = [v for values in lists for v in values if isinstance(v, torch.Tensor)]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, t in enumerate(flat):
            by_dtype.setdefault(t.dtype, []).append(j)
        parts: list[torch.Tensor] = []
        self._order: list[int] = []
        for dtype, index in by_dtype.items():
            stacked = torch.stack([flat[j] if flat[j].dim() == 0 else flat[j].reshape(()) for j in index])
            parts.append(stacked if dtype is torch.float64 else stacked.double())
            self._order.extend(index)
        self._event: Any = None
        self._host: torch.Tensor | list[float]
        if not parts:
            self._host = []
            return
        joined = parts[0] if len(parts) == 1 else torch.cat(parts)
        if not defer:
            self._host = joined.tolist()
            return
        host = torch.empty(joined.shape, dtype=torch.float64, pin_memory=True)
        host.copy_(joined, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(joined.device))
        self._host = host

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())

    def lists(self) -> list[list[float]]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        read = self._host if isinstance(self._host, list) else self._host.tolist()
        by_place = [0.0] * len(read)
        for j, value in zip(self._order, read, strict=True):
            by_place[j] = value
        out: list[list[float]] = []
        k = 0
        for values in self._lists:
            row = []
            for v in values:
                if isinstance(v, torch.Tensor):
                    row.append(by_place[k])
                    k += 1
                else:
                    row.append(float(v))
            out.append(row)
        return out


def _reduce(values: list[float], reduce: Callable[[list[float]], float]) -> float:
    """``reduce(values)``, NaN when any value is NaN, as torch's reductions give it."""
    return math.nan if any(map(math.isnan, values)) else float(reduce(values))


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
