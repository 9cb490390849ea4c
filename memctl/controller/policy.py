"""Budget policy: turn layer statistics and an activation budget into per-layer bits.

NOTE [ Allocation problem ]
Each layer l saved float tensors of sizes n_{l,i} last step. Choice b costs
Σ_i packed_nbytes(n_{l,i}, b) bytes (the quantiser's exact record size, plus the 1-bit
masks of ReLU outputs, NOTE [ ReLU masks ]) and adds
C_l / (2^b − 1)² to the gradient variance (NOTE [ Sensitivity ]); "keep" costs the raw
bytes and adds nothing. With a budget A, the bytes the allocation does not control
(small tensors, non-float tensors, codec fallbacks) come off first and the rest is the
knapsack's capacity. Without a budget the capacity is what every layer would take at the
configured average bits (interpolated between neighbouring choices), with "keep"
excluded, so the average holds while sensitive layers get more bits than others.
The objectives and solvers: docs/design.md, "The allocation".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from memctl import allocation
from memctl.controller.config import KEEP_BITS, CodecMode, ControllerConfig, Objective
from memctl.controller.stats import LayerState

__all__ = ["PolicyResult", "allocate", "bytes_per_sample", "default_bits", "fixed_bytes", "recommend_batch"]


@dataclass(frozen=True)
class PolicyResult:
    bits: dict[str, float]
    error_bounds: dict[str, float] = field(default_factory=dict)
    solver: str = "none"
    status: str = ""
    time_s: float = 0.0
    objective: float = 0.0
    feasible: bool = True
    predicted_bytes: int = 0
    min_bytes: int = 0


def default_bits(config: ControllerConfig) -> int:
    """The bit choice closest to the configured average (used before the first allocation)."""
    return min(config.bit_choices, key=lambda b: (abs(b - config.bits), -b))


def _choice_bytes(s: LayerState, bits: float, group_size: int) -> int:
    """Bytes layer ``s``'s controlled tensors take at ``bits`` (KEEP_BITS: uncompressed)."""
    if bits >= KEEP_BITS:
        return sum(s.numels) * s.element_size
    from memctl.codecs.quantize.codec import packed_nbytes

    return sum(packed_nbytes(n, int(bits), group_size) for n in s.numels) + s.mask_bytes


def _choices(config: ControllerConfig, keep: bool) -> list[int]:
    return [*config.bit_choices, *([KEEP_BITS] if keep else [])]


def _cost_matrices(
    layers: list[LayerState], config: ControllerConfig, choices: list[int], fallback_g2: float
) -> tuple[np.ndarray, np.ndarray]:
    nbytes = np.zeros((len(layers), len(choices)), dtype=np.float64)
    variance = np.zeros_like(nbytes)
    for i, s in enumerate(layers):
        c = s.sensitivity(fallback_g2)
        for k, b in enumerate(choices):
            nbytes[i, k] = _choice_bytes(s, b, config.group_size)
            variance[i, k] = 0.0 if b >= KEEP_BITS else c / float(2**b - 1) ** 2
    return nbytes, variance


def _bytes_at_average(layers: list[LayerState], config: ControllerConfig) -> float:
    """Σ_l bytes at ``config.bits``, interpolating between neighbouring bit choices."""
    bits = config.bits
    lower = max(b for b in config.bit_choices if b <= bits)
    upper = min(b for b in config.bit_choices if b >= bits)
    total = 0.0
    for s in layers:
        lo = _choice_bytes(s, lower, config.group_size)
        hi = _choice_bytes(s, upper, config.group_size)
        frac = 0.0 if upper == lower else (bits - lower) / (upper - lower)
        total += lo + frac * (hi - lo)
    return total


def allocate(
    layers: list[LayerState],
    config: ControllerConfig,
    activation_budget: int | None,
    fallback_g2: float,
    fixed: int,
    grad_sq_total: float | None = None,
) -> PolicyResult:
    """Per-layer bits for the next steps (see NOTE [ Allocation problem ]).

    ``layers`` are those that saved float tensors the allocation controls; ``fixed`` is
    what every layer saved that it does not control.
    """
    if not layers:
        return PolicyResult(bits={}, status="no layers saved activations")
    keep = config.allow_keep and activation_budget is not None
    choices = _choices(config, keep)
    nbytes, variance = _cost_matrices(layers, config, choices, fallback_g2)
    if activation_budget is None:
        capacity = _bytes_at_average(layers, config)
    else:
        capacity = float(activation_budget - fixed)
    int_bytes = [[int(v) for v in row] for row in nbytes]
    var_rows = variance.tolist()
    if config.objective is Objective.BYTES:
        bound = config.variance_bound * (grad_sq_total if grad_sq_total else float(variance[:, 0].sum()))
        problem = allocation.Problem(int_bytes, var_rows, objective=Objective.BYTES, variance_bound=bound)
    else:
        problem = allocation.Problem(int_bytes, var_rows, objective=Objective.VARIANCE,
                                     budget_bytes=max(int(capacity), 1))
    result = allocation.solve(problem, time_limit_s=config.solver_time_limit_s, method=config.solver)
    bits = {s.name: float(choices[k]) for s, k in zip(layers, result.choice, strict=True)}
    error_bounds: dict[str, float] = {}
    if config.codec is CodecMode.ERRORBOUND:
        for s in layers:
            b = bits[s.name]
            total = sum(s.numels)
            if b < KEEP_BITS and s.ema_range_term is not None and total > 0:
                mean_range = math.sqrt(max(s.ema_range_term, 0.0) * s.batch / total)
                if mean_range > 0:
                    error_bounds[s.name] = mean_range / (2.0 * (2.0**b - 1.0))
    min_bytes = int(nbytes.min(axis=1).sum()) + fixed
    feasible = result.feasible
    if activation_budget is not None and min_bytes > activation_budget:
        feasible = False
    return PolicyResult(
        bits=bits,
        error_bounds=error_bounds,
        solver=str(getattr(result.solver, "value", result.solver)),
        status=result.status,
        time_s=result.time_s,
        objective=float(result.objective),
        feasible=feasible,
        predicted_bytes=int(result.total_bytes) + fixed,
        min_bytes=min_bytes,
    )


def fixed_bytes(layers: list[LayerState]) -> int:
    """Bytes saved last step that no bit choice changes (small, non-float, fallbacks)."""
    return sum(s.fixed_bytes + s.other_bytes for s in layers)


def bytes_per_sample(layers: list[LayerState], config: ControllerConfig, batch: int) -> float:
    """Activation bytes per sample at the layers' current bits."""
    total = 0
    for s in layers:
        b = s.bits if s.bits is not None else default_bits(config)
        total += _choice_bytes(s, b, config.group_size) + s.fixed_bytes + s.other_bytes
    return total / max(batch, 1)


def recommend_batch(result: PolicyResult, batch: int, activation_budget: int) -> int:
    """Largest batch whose lowest-precision activations fit the budget (at least 1)."""
    if result.min_bytes <= 0:
        return batch
    return max(1, int(batch * activation_budget // result.min_bytes))
