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

The variance of each choice is the calibrated model's (NOTE [ Calibration ]).

NOTE [ Default policy ]
``Controller(model, optimizer)`` with neither ``bits`` nor a budget solves AC-GC's problem:
the fewest bytes whose added variance stays under ``variance_bound`` times the minibatch
gradient's own variance (measured by the calibration; its squared norm, then the closed
form's 1-bit total, until it is). ``bits=`` keeps least variance at that average, a budget
least variance within it; an explicit ``objective`` overrides all. Every policy respects the
floors of the convergence guard (NOTE [ Convergence guard ]) and gives no layer 1 bit before
the calibration measured it there (with the probes off, never). Before its first allocation
(the first step, and a layer first seen later) the default policy keeps the most precise bit
choice: that step runs before the calibration has measured anything, and one step at 2 bits
on a layer that cannot take them (a ViT's patch embedding, MobileNetV3's hardswish inputs:
hundreds of times the gradient's own variance) is one very large random update, which Adam's
second-moment estimate then remembers for hundreds of steps (ViT: 74% of plain's loss drop
over 20 steps at the default policy although every later step ran at 8 bits).

The bound is 0.05. Added variance ``v · tr Var(g)`` is what the same training at batch
``N / (1 + v)`` has anyway (the minibatch gradient's variance is ``tr Var(g₁) / N``), so
0.05 costs what a batch 5% smaller costs. A bound of 0.01 (a batch 1% smaller) kept
4 bits on most layers of small CNNs for no measurable gain (``benchmarks/fidelity.py``, 20
steps, seed 0: DigitsNet 8.4x at 98.3% of plain's loss drop, 11.7x at 97.6% with 0.05;
MobileNetV3 9.5x and 10.0x; ``transformer_block`` 6.8x and 8.0x; every model of the
benchmark at 94.6% of plain's drop or more with 0.05; ``benchmarks/convergence.py``, text
LM, 300 steps, 3 seeds: +0.45-0.67% of plain's validation loss with 0.01, +0.59-0.63%
with 0.05 at 9.9-10.0x). It is still tighter than AC-GC's own released configuration,
which bounds each layer's weight-gradient error by the order of that gradient's squared
norm (error exponent 0, ``e = 2^-0``, in its ResNet-50 scripts, github.com/rdevans0/acgc).
``bits=`` and budgets ask for a size, not a noise level, and keep a looser bound of their own:
the convergence guard's (``guard_bound``, 0.3, what a batch about a quarter smaller has
anyway) raises a layer only where the size asked for adds more than that. It was 1.0 (a
batch half as large): Mamba (transformers' reference scan, 20 steps) at ``bits=2`` measured
0.86 at its first probe, under it, and kept 83% of plain's loss drop; at 0.3 its two output
projections (heavy-tailed inputs) go to 4 bits, 2.03 bits on average, and it keeps 91%;
timm's MobileOne-S0 89% at 12.5x -> 93% at 11.4x. The sixteen models of
``benchmarks/fidelity.py`` train the same at ``bits=2`` with either, and so do the two of
them the guard acted on (EfficientNet-B0, ``transformer_block``) under its budget.

NOTE [ Warm-up ]
``warmup_steps=N`` saves every tensor the allocation controls at the widest bit choice for
the controller's first N optimizer steps (a loaded state's count included), whatever the
policy picked (the allocation still runs, and its widths apply from step N on); with a
budget set the budget decides, as always. The noise that costs is the first steps': Adam's
step is ``m̂ / (√v̂ + ε)``, and while v̂ holds a few squared gradients a coordinate's step
is nearly its gradient's sign at the full rate, so noise that flips a small gradient moves
the weight the whole step; v̂ then remembers those gradients for ~1/(1 - β₂) steps. Measured
on the demo's digits (``benchmarks/convergence.py --schedule cosine``, Adam, 300 steps, ten
seeds, against the mean of three plain runs a seed): ``bits=2`` +3.59% ± 0.55 of plain's
validation loss; ``bits=2`` attached only from step 50 (plain before) +0.44% ± 0.56, as
close as plain's own reruns (+0.16-0.28%); ``bits=2`` for the first 50 steps only, then
plain, +3.12% ± 0.85. With ``warmup_steps=50``: ``bits=2`` **+0.17% ± 0.63**
(``warmup_steps=20``: +1.35% ± 0.58, the window is tens of steps), the default policy +0.13%
± 0.72 (+1.56% ± 0.66 without; it keeps the widest choice at its first step, NOTE [ Default
policy ], and spends 2.2-3.2 bits over the first 50-150 steps as its probes find the
sensitive layers), both at 12.1x at the end as without. On the text model (AdamW, constant
rate, seeds 0 and 1) ``bits=2`` +0.47%/+0.67% -> +0.18%/+0.29%, the default +0.90%/+0.66% ->
+0.38%/+0.42%. It is off by default because those steps hold about four times the activation
memory of 2-bit steps, so a run that fits only at 2 bits would not start, and a run shorter
than the warm-up would run at 8 bits throughout; ``bits=`` asks for a size, and the warm-up
is the user's to grant. What those first steps' noise cost on digits was nearly all the
head's (NOTE [ The head's input ] in heads.py): with the head's input at its floor, without a
warm-up, ``bits=2`` ends +0.44% ± 0.80 and the default policy +0.06% ± 0.52.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from memctl import allocation
from memctl.controller.calibration import closed_form
from memctl.controller.config import KEEP_BITS, CodecMode, ControllerConfig, Objective
from memctl.controller.stats import LayerState

__all__ = [
    "PolicyResult", "VarianceFn", "allocate", "bytes_per_sample", "default_bits", "error_bound_for",
    "fixed_bytes", "recommend_batch", "resolve_objective",
]

#: ``variance_fn(layer, bits) -> added variance``: the (calibrated) variance model.
VarianceFn = Callable[[LayerState, int], float]


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
    min_bytes_unguarded: int = 0
    """Least bytes with no floors at all (NOTE [ Convergence guard ])."""
    objective_kind: str = ""
    bound: float | None = None
    predicted_variance: float = 0.0


def default_bits(config: ControllerConfig, adaptive: bool = False) -> int:
    """The bit choice closest to the configured average (used before the first allocation;
    2 bits, or the nearest choice, without one). ``adaptive``: the default policy's first
    step, which runs before anything was measured, takes the most precise choice
    (NOTE [ Default policy ])."""
    if adaptive:
        return max(config.bit_choices)
    target = config.bits if config.bits is not None else 2.0
    return min(config.bit_choices, key=lambda b: (abs(b - target), -b))


def resolve_objective(config: ControllerConfig, has_budget: bool) -> Objective:
    """NOTE [ Default policy ]: an explicit ``objective`` wins; otherwise least variance under
    a budget or at ``bits`` average bits, and AC-GC's fewest bytes under the variance bound
    when neither was given."""
    if config.objective is not None:
        return config.objective
    return Objective.VARIANCE if has_budget or config.bits is not None else Objective.BYTES


def _choice_bytes(s: LayerState, bits: float, group_size: int) -> int:
    """Bytes layer ``s``'s controlled tensors take at ``bits`` (KEEP_BITS: uncompressed)."""
    if bits >= KEEP_BITS:
        return sum(s.numels) * s.element_size
    from memctl.codecs.quantize.codec import packed_nbytes

    # Once per distinct size: a GRU's layer saves hundreds of tensors of one size per step.
    b = int(bits)
    return sum(packed_nbytes(n, b, group_size) * k for n, k in Counter(s.numels).items()) + s.mask_bytes


def _choices(config: ControllerConfig, keep: bool) -> list[int]:
    return [*config.bit_choices, *([KEEP_BITS] if keep else [])]


def _closed_form_fn(fallback_g2: float) -> VarianceFn:
    def fn(s: LayerState, b: int) -> float:
        return closed_form(s, fallback_g2, b)

    return fn


def _layer_choices(layers: list[LayerState], choices: list[int],
                   floors: Mapping[str, float]) -> list[list[int]]:
    """Each layer's choices at or above its floor (the highest choice if the floor is above all)."""
    out = []
    for s in layers:
        floor = floors.get(s.name)
        mine = [b for b in choices if floor is None or b >= floor]
        out.append(mine or [choices[-1]])
    return out


def _cost_rows(layers: list[LayerState], config: ControllerConfig, per_layer: list[list[int]],
               variance_fn: VarianceFn) -> tuple[list[list[int]], list[list[float]]]:
    nbytes = [[_choice_bytes(s, b, config.group_size) for b in mine] for s, mine in zip(layers, per_layer,
                                                                                           strict=True)]
    variance = [[0.0 if b >= KEEP_BITS else max(float(variance_fn(s, b)), 0.0) for b in mine]
                for s, mine in zip(layers, per_layer, strict=True)]
    return nbytes, variance


def _bytes_at_average(layers: list[LayerState], config: ControllerConfig) -> float:
    """Σ_l bytes at ``config.bits``, interpolating between neighbouring bit choices."""
    bits = config.bits if config.bits is not None else float(default_bits(config))
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
    *,
    variance_fn: VarianceFn | None = None,
    floors: Mapping[str, float] | None = None,
    evidence_floors: Mapping[str, float] | None = None,
) -> PolicyResult:
    """Per-layer bits for the next steps (see NOTE [ Allocation problem ]).

    ``layers`` are those that saved float tensors the allocation controls; ``fixed`` is
    what every layer saved that it does not control. ``variance_fn`` is the variance model
    (the closed form when ``None``); ``grad_sq_total`` the variance the BYTES objective's
    bound is relative to. ``floors`` (the convergence guard's) and ``evidence_floors``
    (the calibration's: no 1 bit before it was measured) are the lowest bits each layer may
    get; under a budget that cannot be met with the evidence floors they are dropped, and
    a budget that cannot be met with the guard's floors comes back infeasible with
    ``min_bytes_unguarded`` saying whether it could be met without them.
    """
    if not layers:
        return PolicyResult(bits={}, status="no layers saved activations")
    keep = config.allow_keep and activation_budget is not None
    choices = _choices(config, keep)
    fn = variance_fn if variance_fn is not None else _closed_form_fn(fallback_g2)
    objective = resolve_objective(config, activation_budget is not None)
    guard = dict(floors or {})
    merged = {**(evidence_floors or {}), **guard}
    for name, f in (evidence_floors or {}).items():
        merged[name] = max(f, guard.get(name, f))
    free_choices = _layer_choices(layers, choices, {})
    free_bytes, _ = _cost_rows(layers, config, free_choices, lambda s, b: 0.0)
    min_unguarded = sum(min(row) for row in free_bytes) + fixed
    attempts = [merged, guard] if activation_budget is not None and merged != guard else [merged]
    for i, active in enumerate(attempts):
        result = _solve(layers, config, activation_budget, fixed, grad_sq_total, fn, choices, active,
                        objective)
        if result.feasible or i == len(attempts) - 1:
            break
    return PolicyResult(**{**result.__dict__, "min_bytes_unguarded": min_unguarded})


def _solve(layers: list[LayerState], config: ControllerConfig, activation_budget: int | None,
           fixed: int, grad_sq_total: float | None, fn: VarianceFn, choices: list[int],
           floors: Mapping[str, float], objective: Objective) -> PolicyResult:
    per_layer = _layer_choices(layers, choices, floors)
    int_bytes, var_rows = _cost_rows(layers, config, per_layer, fn)
    floor_bytes = sum(min(row) for row in int_bytes)
    bound: float | None = None
    if activation_budget is None:
        capacity = max(_bytes_at_average(layers, config), float(floor_bytes))
    else:
        capacity = float(activation_budget - fixed)
    if objective is Objective.BYTES:
        reference = grad_sq_total if grad_sq_total else float(sum(row[0] for row in var_rows))
        bound = config.variance_bound * reference
        problem = allocation.Problem(int_bytes, var_rows, objective=Objective.BYTES, variance_bound=bound)
    else:
        problem = allocation.Problem(int_bytes, var_rows, objective=Objective.VARIANCE,
                                     budget_bytes=max(int(capacity), 1))
    result = allocation.solve(problem, time_limit_s=config.solver_time_limit_s, method=config.solver)
    bits = {s.name: float(mine[k]) for s, mine, k in zip(layers, per_layer, result.choice, strict=True)}
    error_bounds: dict[str, float] = {}
    if config.codec is CodecMode.ERRORBOUND:
        for s in layers:
            eb = error_bound_for(s, bits[s.name])
            if eb is not None:
                error_bounds[s.name] = eb
    min_bytes = floor_bytes + fixed
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
        objective_kind=objective.value,
        bound=bound,
        predicted_variance=float(result.total_variance),
    )


def error_bound_for(s: LayerState, bits: float) -> float | None:
    """The error-bound codec's bound for ``bits`` on layer ``s``: e = R / (2 (2^b − 1))."""
    total = sum(s.numels)
    if bits >= KEEP_BITS or s.ema_range_term is None or total <= 0:
        return None
    mean_range = math.sqrt(max(s.ema_range_term, 0.0) * s.batch / total)
    return mean_range / (2.0 * (2.0**bits - 1.0)) if mean_range > 0 else None


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
