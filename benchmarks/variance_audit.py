"""The calibrated variance model against fresh measurements: the ``varcheck`` audit.

After a run, with the controller still attached, :func:`audit` takes the variance model's
prediction for each of the ``layers`` largest layers at every bit width, then measures the
same (layer, width) on one more step (the last batch again, at the weights training left)
with ``draws`` fresh replays (NOTE [ Replay ]:
that layer compressed, every other exact) and compares the prediction with the mean of
those draws. A single draw spreads by up to ~7x on a BatchNorm input, so the mean of a few
is what a factor of 2 can be judged against. Used by ``benchmarks/fidelity.py --configs
varcheck``; prints nothing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch


def audit(ctl: Any, loss_fn: Callable[[], torch.Tensor], *, layers: int = 12, draws: int = 3,
          seed: int = 12345) -> list[dict[str, Any]]:
    """Per (layer, width): ``predicted`` (before), ``draws`` and their ``measured`` mean, and
    ``kind``: ``measured`` (that pair was measured in the run), ``other_width`` (the layer was,
    at another width), ``unmeasured``."""
    from memctl.controller.config import KEEP_BITS
    from memctl.controller.probe_share import replay_module
    from memctl.controller.replay import Capture, exact, only
    from memctl.controller.stats import median_grad_sq

    model = ctl.model
    cal = ctl._calibration
    states = [s for s in ctl._layers.values() if s.numels]
    g2 = median_grad_sq(states)
    chosen = sorted(states, key=lambda s: (-sum(s.numels), s.name))[:layers]
    widths = [b for b in ctl.config.bit_choices if b < KEEP_BITS]
    predicted = {(s.name, b): cal.estimate(s, g2, b) for s in chosen for b in widths}
    kinds = {(s.name, b): ("measured" if b in cal.measured.get(s.name, {}) else
                           "other_width" if cal.measured.get(s.name) else "unmeasured")
             for s in chosen for b in widths}
    replayer = ctl._replayer
    holder: dict[str, Capture] = {}

    def pre(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        holder["c"] = replayer.capture(args, kwargs)

    def post(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        replayer.watch_outputs(holder["c"], output)

    ctl._replaying = True  # the controller's own hooks stand aside, as in a probe
    out: list[dict[str, Any]] = []
    buffers = [b.detach().clone() for b in model.buffers()]
    h1 = model.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = model.register_forward_hook(post, with_kwargs=True)
    try:
        loss = loss_fn()
        h1.remove()
        h2.remove()
        grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad],
                                    allow_unused=True)
        del grads
        capture = holder.get("c")
        if capture is None or not capture.out_grads:
            return out
        target = replay_module(model)
        ref = replayer.gradient(target, capture, exact, seed)
        if ref is None:
            return out
        ref_sq = float(ref.square().sum())
        for s in chosen:
            for b in widths:
                values = []
                for i in range(draws):
                    g = replayer.gradient(target, capture, only(s.name, float(b), None), seed + 1 + i)
                    if g is not None:
                        values.append(float((g - ref).square().sum()))
                finite = [v for v in values if math.isfinite(v)]
                out.append({"layer": s.name, "bits": b, "predicted": predicted[(s.name, b)],
                            "draws": values, "measured": statistics.fmean(finite) if finite else math.nan,
                            "kind": kinds[(s.name, b)], "ref_sq": ref_sq, "unit": cal.unit()})
    finally:
        h1.remove()
        h2.remove()
        ctl._replaying = False
        ctl._tracker.reset()
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
    return out


def summarise_audit(model: str, pairs: list[dict[str, Any]]) -> list[str]:
    """One line: the share of (layer, width) pairs whose prediction is within 2x of the mean
    of the fresh draws, overall, by width and by what the prediction stood on."""
    if not pairs:
        return []

    def within(p: dict[str, Any]) -> bool:
        a, m = p["predicted"], p["measured"]
        if a == 0 and m == 0:
            return True
        return a > 0 and m > 0 and math.isfinite(m) and max(a / m, m / a) <= 2.0

    def share(sel: list[dict[str, Any]]) -> str:
        return f"{sum(within(p) for p in sel)}/{len(sel)}"

    widths = sorted({p["bits"] for p in pairs})
    kinds = [k for k in ("measured", "other_width", "unmeasured") if any(p["kind"] == k for p in pairs)]
    ok = sum(within(p) for p in pairs)
    worst = max(pairs, key=lambda p: _factor(p["predicted"], p["measured"]))
    line = (f"  audit {model}: predicted vs the mean of fresh draws within 2x: {ok}/{len(pairs)} "
            f"({100.0 * ok / len(pairs):.0f}%); by width "
            + ", ".join(f"{b}b {share([p for p in pairs if p['bits'] == b])}" for b in widths)
            + "; by kind " + ", ".join(f"{k} {share([p for p in pairs if p['kind'] == k])}" for k in kinds)
            + f"; worst {_factor(worst['predicted'], worst['measured']):.3g}x "
              f"({worst['layer']}@{worst['bits']}b)")
    return [line, *_relative(model, pairs)]


def _relative(model: str, pairs: list[dict[str, Any]]) -> list[str]:
    """The same pairs over each side's own scale (NOTE [ Gradient scale ]): the prediction over
    the model's unit ``S``, the draws over the exact gradient's ‖g‖² at the audit. Within 2x
    here and not above, the per-layer ratios hold and the scale ``S`` has moved away."""
    scaled = [p for p in pairs if p.get("unit") and p.get("ref_sq")]
    if not scaled:
        return []
    factors = [_factor(p["predicted"] / p["unit"], p["measured"] / p["ref_sq"]) for p in scaled]
    ok = sum(f <= 2.0 for f in factors)
    first = scaled[0]
    return [f"  audit {model}, over each side's scale: within 2x {ok}/{len(scaled)}; median "
            f"{statistics.median(factors):.3g}x; unit S {first['unit']:.4g}, exact |g|^2 at the audit "
            f"{first['ref_sq']:.4g}"]


def _factor(a: float, m: float) -> float:
    if a == 0 and m == 0:
        return 1.0
    if not (a > 0 and m > 0 and math.isfinite(m)):
        return math.inf
    return max(a / m, m / a)
