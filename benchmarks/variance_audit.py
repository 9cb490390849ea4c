"""The calibrated variance model against fresh measurements: the ``varcheck`` audit.

After a run, with the controller still attached, :func:`audit` takes the variance model's
prediction for each of the ``layers`` largest layers at every bit width, then measures the
same (layer, width) at the weights training left, on each of the run's distinct batches,
with ``draws`` fresh replays a batch (NOTE [ Replay ]: that layer compressed, every other
exact), and compares the prediction with the mean over batches of those draws' means. Both
are in the metric the calibration measures in (NOTE [ Update metric ]: Adam's update, each
parameter's gradient over its root mean second moment, or the gradient's own).

Why every batch: the model predicts what a layer adds at the next steps, whichever batch
they bring, and what one batch adds follows that batch's gradient, which moves far from one
batch to the next early in training (MobileNetV3-Small of ``fidelity.py``: the exact ‖g‖²
of consecutive steps 126, 92, 26, 41, 85). A figure on the last batch alone (``measured_last``,
the audit's only figure until 2026-11-28) judges the prediction against one draw of that.
A single replay also spreads by up to ~7x on a BatchNorm input, so each batch's figure is the
mean of a few. Used by ``benchmarks/fidelity.py --configs varcheck``; prints nothing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch


def audit(ctl: Any, loss_fns: Callable[[], torch.Tensor] | Sequence[Callable[[], torch.Tensor]], *,
          layers: int = 12, draws: int = 3, seed: int = 12345) -> list[dict[str, Any]]:
    """Per (layer, width): ``predicted`` (before), ``draws`` and ``per_batch`` (each batch's
    mean of its draws), ``measured`` (the mean over batches), ``measured_last`` (the last
    batch's), ``ref_sq`` / ``ref_sq_last`` (the exact ‖g‖², mean over batches / last) and
    ``kind``: ``measured`` (that pair was measured in the run), ``other_width`` (the layer
    was, at another width), ``unmeasured``. ``loss_fns``: one loss function per batch, the
    last one last (a single function: that batch alone)."""
    from memctl.controller.config import KEEP_BITS

    model = ctl.model
    cal = ctl._calibration
    states = [s for s in ctl._layers.values() if s.numels]
    g2 = cal.median_grad_sq(states)  # the median the controller's own estimates stand on
    chosen = sorted(states, key=lambda s: (-sum(s.numels), s.name))[:layers]
    widths = [b for b in ctl.config.bit_choices if b < KEEP_BITS]
    predicted = {(s.name, b): cal.estimate(s, g2, b) for s in chosen for b in widths}
    kinds = {(s.name, b): ("measured" if b in cal.measured.get(s.name, {}) else
                           "other_width" if cal.measured.get(s.name) else "unmeasured")
             for s in chosen for b in widths}
    fns = [loss_fns] if callable(loss_fns) else list(loss_fns)
    per_pair: dict[tuple[str, int], list[list[float]]] = {pair: [] for pair in predicted}
    refs: list[float] = []
    buffers = [b.detach().clone() for b in model.buffers()]
    ctl._replaying = True  # the controller's own hooks stand aside, as in a probe
    try:
        for k, fn in enumerate(fns):
            # the last batch draws as the single-batch audit did (seed + 0)
            ref_sq = _measure_batch(ctl, fn, chosen, widths, draws, seed + 1000 * (len(fns) - 1 - k),
                                    per_pair)
            with torch.no_grad():  # every batch at the batch norms' statistics as training left them
                for b, saved in zip(model.buffers(), buffers, strict=True):
                    b.copy_(saved)
            if ref_sq is not None:
                refs.append(ref_sq)
    finally:
        ctl._replaying = False
        ctl._tracker.reset()
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
    if not refs:
        return []
    out: list[dict[str, Any]] = []
    for s in chosen:
        for b in widths:
            batches = per_pair[(s.name, b)]
            means = [_finite_mean(v) for v in batches]
            kept = [m for m in means if math.isfinite(m)]
            out.append({"layer": s.name, "bits": b, "predicted": predicted[(s.name, b)],
                        "draws": [v for values in batches for v in values], "per_batch": means,
                        "measured": statistics.fmean(kept) if kept else math.nan,
                        "measured_last": means[-1] if means else math.nan,
                        "kind": kinds[(s.name, b)], "ref_sq": statistics.fmean(refs),
                        "ref_sq_last": refs[-1], "batches": len(refs), "unit": cal.unit()})
    return out


def _measure_batch(ctl: Any, loss_fn: Callable[[], torch.Tensor], chosen: list[Any], widths: list[int],
                   draws: int, seed: int, per_pair: dict[tuple[str, int], list[list[float]]]) -> float | None:
    """One batch: capture its step, replay it exact and with each chosen layer at each width;
    append the draws to ``per_pair``; the exact ‖g‖² (None when the step cannot be replayed)."""
    from memctl.controller.probe_share import replay_module
    from memctl.controller.replay import Capture, exact, only

    model = ctl.model
    replayer = ctl._replayer
    holder: dict[str, Capture] = {}

    def pre(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        holder["c"] = replayer.capture(args, kwargs)

    def post(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        replayer.watch_outputs(holder["c"], output)

    h1 = model.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = model.register_forward_hook(post, with_kwargs=True)
    try:
        loss = loss_fn()
    finally:
        h1.remove()
        h2.remove()
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    del grads, loss
    capture = holder.get("c")
    if capture is None or not capture.out_grads:
        return None
    target = replay_module(model)
    replayer.begin_metric(target)  # as the probes measure (NOTE [ Update metric ])
    try:
        ref = replayer.gradient(target, capture, exact, seed)
        if ref is None:
            return None
        for s in chosen:
            for b in widths:
                values = []
                for i in range(draws):
                    g = replayer.gradient(target, capture, only(s.name, float(b), None), seed + 1 + i)
                    if g is not None:
                        values.append(float((g - ref).square().sum()))
                per_pair[(s.name, b)].append(values)
        return float(ref.square().sum())
    finally:
        replayer.end_metric()


def _finite_mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def summarise_audit(model: str, pairs: list[dict[str, Any]], per_batch: bool = True) -> list[str]:
    """The share of (layer, width) pairs whose prediction is within 2x of the measurement,
    overall, by width and by what the prediction stood on: against the mean over the batches,
    then over each side's scale, then against the last batch alone (the audit before it
    measured every batch). ``per_batch``: also each batch alone, in the order training last
    took them (``fidelity.py``'s batches, which training cycles over)."""
    if not pairs:
        return []
    batches = pairs[0].get("batches", 1)
    lines = [_line(f"  audit {model}: predicted vs the mean of fresh draws over {batches} "
                   f"batch{'es' if batches != 1 else ''}", pairs, "measured"),
             *_relative(model, pairs)]
    if per_batch and batches > 1 and all(len(p.get("per_batch", ())) == batches for p in pairs):
        parts = []
        for k in range(batches):
            factors = [_factor(p["predicted"], p["per_batch"][k]) for p in pairs]
            ok = sum(f <= 2.0 for f in factors)
            parts.append(f"{ok}/{len(pairs)} (median {statistics.median(factors):.3g}x)")
        lines.append(f"  audit {model}, each batch alone, in the order training last took them (the first "
                     f"is the next step's, the last the step just taken): " + ", ".join(parts))
    return lines


def _line(head: str, pairs: list[dict[str, Any]], key: str) -> str:
    def within(p: dict[str, Any]) -> bool:
        return _factor(p["predicted"], p[key]) <= 2.0

    def share(sel: list[dict[str, Any]]) -> str:
        return f"{sum(within(p) for p in sel)}/{len(sel)}"

    widths = sorted({p["bits"] for p in pairs})
    kinds = [k for k in ("measured", "other_width", "unmeasured") if any(p["kind"] == k for p in pairs)]
    ok = sum(within(p) for p in pairs)
    factors = [_factor(p["predicted"], p[key]) for p in pairs]
    worst = max(pairs, key=lambda p: _factor(p["predicted"], p[key]))
    under = sum(1 for p in pairs if p["predicted"] < p[key] / 2.0)
    return (f"{head} within 2x: {ok}/{len(pairs)} ({100.0 * ok / len(pairs):.0f}%); by width "
            + ", ".join(f"{b}b {share([p for p in pairs if p['bits'] == b])}" for b in widths)
            + "; by kind " + ", ".join(f"{k} {share([p for p in pairs if p['kind'] == k])}" for k in kinds)
            + f"; median {statistics.median(factors):.3g}x, {under} under by more than 2x"
            + f"; worst {_factor(worst['predicted'], worst[key]):.3g}x ({worst['layer']}@{worst['bits']}b)")


def _relative(model: str, pairs: list[dict[str, Any]]) -> list[str]:
    """The same pairs over each side's own scale (NOTE [ Gradient scale ]): the prediction over
    the model's unit ``S``, the draws over the exact gradient's ‖g‖² at the audit (the mean
    over its batches). Within 2x here and not above, the per-layer ratios hold and the scale
    ``S`` has moved away."""
    scaled = [p for p in pairs if p.get("unit") and p.get("ref_sq")]
    if not scaled:
        return []
    factors = [_factor(p["predicted"] / p["unit"], p["measured"] / p["ref_sq"]) for p in scaled]
    ok = sum(f <= 2.0 for f in factors)
    first = scaled[0]
    return [f"  audit {model}, over each side's scale: within 2x {ok}/{len(scaled)}; median "
            f"{statistics.median(factors):.3g}x; unit S {first['unit']:.4g}, exact |g|^2 at the audit "
            f"{first['ref_sq']:.4g}" + (f" (last batch {first['ref_sq_last']:.4g})" if "ref_sq_last" in first
                                         else "")]


def _factor(a: float, m: float) -> float:
    if a == 0 and m == 0:
        return 1.0
    if not (a > 0 and m > 0 and math.isfinite(m)):
        return math.inf
    return max(a / m, m / a)
