"""One calibration probe: the replays of NOTE [ Calibration ] at a step boundary."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from memctl.controller.calibration import Calibration
from memctl.controller.config import KEEP_BITS, CodecMode, ControllerConfig
from memctl.controller.grouping import footprint, inside, plan, prior_footprints, shares, sound
from memctl.controller.outliers import REDRAWS, absurd, robust_draws, robust_value, suspect
from memctl.controller.policy import error_bound_for
from memctl.controller.replay import Capture, ChoiceFn, Replayer, exact, several
from memctl.controller.stats import LayerState, grad_sq_names

__all__ = ["ProbeResult", "run_probe"]


@dataclass
class ProbeResult:
    """What one probe measured."""

    measured: list[tuple[str, int, float]] = field(default_factory=list)
    grad_sq: float | None = None
    noise: float | None = None
    added: float | None = None
    """Added variance of the allocation in use (None when nothing was compressed)."""
    predicted: float | None = None
    """The calibrated model's prediction of ``added``."""
    tail: bool = False
    """Whether a draw of the allocation in use was absurd (NOTE [ Robust measurements ])."""
    unsafe: list[tuple[str, int]] = field(default_factory=list)
    """(layer, bits) pairs that produced an absurd draw."""
    redraws: int = 0
    """Replays re-run because their first draw was suspect."""
    grouped: int = 0
    """Replays that measured several layers at once (NOTE [ Several layers per replay ])."""
    uniform: list[tuple[int, float]] = field(default_factory=list)
    """(bits, added variance) of the replays with every layer at ``bits`` (NOTE [ Unmeasured
    layers ]), fitted into the calibration here only when recording."""
    replays: int = 0
    seconds: float = 0.0
    restarted: str | None = None
    """The metric the calibration measured in before this probe, when it changed and what was
    measured there was dropped (NOTE [ Update metric ])."""


def run_probe(model: torch.nn.Module, replayer: Replayer, capture: Capture, calibration: Calibration,
              layers: list[LayerState], in_use: ChoiceFn, config: ControllerConfig, fallback_g2: float,
              step: int, train_s: float, *, record: bool = True) -> ProbeResult:
    """Replay the captured step: exact, the allocation in use, two half batches, then layers.

    With ``record=False`` the measurements are only returned, not folded into
    ``calibration`` (under a process group they are reduced across ranks first,
    NOTE [ Calibration across ranks ]).
    """
    result = ProbeResult()
    start = time.perf_counter()
    share = calibration.share()  # its cost is paid back at this share (NOTE [ Probe cost ])
    buffers = [b.detach().clone() for b in model.buffers()]
    seed = (step * 0x2545F491 + 17) & 0xFFFFFFFF
    try:
        result.restarted = calibration.use_metric(replayer.begin_metric(model))
        exact_g = _timed(calibration, result, lambda: replayer.gradient(model, capture, exact, seed))
        if exact_g is None:
            return result
        result.grad_sq = float(exact_g.square().sum())
        scale = max(result.grad_sq, calibration.grad_noise or 0.0)

        def distance(choice: ChoiceFn, salt: int) -> Callable[[int], float | None]:
            def draw(i: int) -> float | None:
                g = _timed(calibration, result, _replay_fn(replayer, model, capture, choice,
                                                           salt + 7919 * (i + 1)))
                result.redraws += 1
                return None if g is None else float((g - exact_g).square().sum())
            return draw

        used = _timed(calibration, result, lambda: replayer.gradient(model, capture, in_use, seed + 1))
        if used is not None:  # NOTE [ Robust measurements ]
            draws = robust_draws(float((used - exact_g).square().sum()), distance(in_use, seed + 1),
                                 scale, None)
            del used
            result.tail = any(absurd(d, scale) for d in draws)
            result.added = robust_value(draws)
        batch = _batch(capture, config.batch_dim)
        if batch is not None and batch >= 2:
            h = batch // 2
            ga = replayer.gradient(model, capture, exact, seed + 2, part=(0, h))
            gb = replayer.gradient(model, capture, exact, seed + 3, part=(h, batch - h))
            if ga is not None and gb is not None:
                result.noise = float((ga - gb).square().sum())
        if record:  # before any layer value: this probe's ‖g‖² is their unit (NOTE [ Gradient scale ])
            calibration.record_reference(result.grad_sq, result.noise, fallback_g2, grad_sq_names(layers))
        if result.added is not None:  # the model's prediction of it, before this probe's layer values
            result.predicted = sum(calibration.estimate(s, fallback_g2, in_use(s.name)[0]) for s in layers)
        scale = max(scale, result.noise or 0.0)
        by_name = {s.name: s for s in layers}
        # NOTE [ Probe cost ]: as many layers as fixed replays (those run, the two halves, one per
        # uniform width while layers are unmeasured), or pairs to refresh once none is; under a
        # process group, which probes at every allocation step, what the share allows
        fixed = result.replays + 2  # those run and the two halves
        missing = calibration.count_unmeasured(layers)
        if missing:
            least = min(fixed + sum(1 for b in config.bit_choices if b >= 2), missing)
        else:
            least = fixed if record else 1
        limit = calibration.allowance(train_s, result.replays + 1, least)  # itself at least 1
        sizes = [p.numel() for p in model.parameters() if p.requires_grad]
        # NOTE [ Doubtful measurements ]: up to half the replays measure doubtful values again first
        everything = calibration.schedule(layers, len(layers) * len(config.bit_choices) * 2, fallback_g2,
                                          doubts_first=max(1, limit // 2), step=step)
        # NOTE [ Several layers per replay ]: measured footprints first, then priors by kind
        prints = {**prior_footprints(model, [n for n in by_name if n not in calibration.footprints]),
                  **calibration.footprints} if config.calibration_groups else {}
        for job in plan(everything, prints, limit):
            _measure(job, by_name, calibration, result, config, fallback_g2, step, scale, sizes, prints,
                     lambda choice, salt: _distance(replayer, model, capture, choice, salt, exact_g,
                                                    calibration, result),
                     seed + 7 + result.replays, record, lambda: replayer.raised)
        if calibration.unmeasured(layers):  # NOTE [ Unmeasured layers ]: after the layer measurements
            for bits in sorted(b for b in config.bit_choices if b >= 2):
                uniform = _uniform(by_name, bits, config)
                g = _timed(calibration, result,
                           _replay_fn(replayer, model, capture, uniform, seed + 5 + bits))
                if g is not None:
                    expected = sum(calibration.estimate(s, fallback_g2, bits) for s in layers) \
                        if bits in calibration.width_factors else None
                    draws = robust_draws(float((g - exact_g).square().sum()),
                                         distance(uniform, seed + 5 + bits), scale, expected)
                    value = robust_value(draws)
                    result.uniform.append((bits, value))
                    if record:  # else every rank fits the ranks' mean (NOTE [ Calibration across ranks ])
                        calibration.fit_width(bits, value, layers, fallback_g2)
    finally:
        replayer.end_metric()
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
        result.seconds = time.perf_counter() - start
        calibration.spend(train_s, result.seconds, share)
        calibration.probes += 1
    if record and result.added is not None:
        calibration.added = result.added
        calibration.added_predicted = result.predicted
    return result


def _measure(job: list[tuple[str, int]], by_name: dict[str, LayerState], calibration: Calibration,
             result: ProbeResult, config: ControllerConfig, fallback_g2: float, step: int, scale: float,
             sizes: list[int], footprints: dict[str, tuple[int, ...]],
             draw: Callable[[ChoiceFn, int], torch.Tensor | None], salt: int, record: bool,
             raised: Callable[[], frozenset[str]] = frozenset) -> None:
    """Measure one replay's layers: one alone, or a group whose errors stay in disjoint
    footprints (NOTE [ Several layers per replay ]); suspect draws re-probed (NOTE [ Robust
    measurements ])."""
    wanted: dict[str, tuple[float, float | None]] = {}
    for name, bits in job:
        eb = error_bound_for(by_name[name], bits) if config.codec is CodecMode.ERRORBOUND else None
        wanted[name] = (float(bits), eb)
    choice = several(wanted)
    prints = {name: footprints.get(name, ()) for name, _ in job}
    grouped = any(prints.values())
    delta = draw(choice, salt)
    if delta is None:
        return
    widened = raised()  # NOTE [ Widths a record is stored at ] in calibration.py
    for name, bits in job:
        calibration.note_width(name, bits, name in widened)
    parts = shares(delta, sizes)
    total = float(delta.square().sum())
    if grouped and not (parts and sound(parts, prints.values())):
        # the premise failed (or a non-finite draw cannot be told apart): measure alone again
        for name in prints:
            calibration.footprints[name] = footprints[name] = ()
        return
    for name, fp in prints.items():  # a prior that held is kept as the layer's footprint
        if fp and grouped:
            calibration.footprints.setdefault(name, fp)

    def values(parts: list[float], total: float) -> dict[str, float]:
        if not grouped:
            return dict.fromkeys(prints, total)
        return {n: inside(parts, fp) for n, fp in prints.items()}

    result.grouped += len(job) > 1
    first = values(parts, total)
    draws = {n: [v] for n, v in first.items()}
    expected = {n: calibration.estimate(by_name[n], fallback_g2, b) if b in calibration.measured.get(n, {})
                else None for n, b in job}
    if any(suspect(v, scale, expected[n]) for n, v in first.items()):
        for i in range(REDRAWS):
            again = draw(choice, salt + 7919 * (i + 1))
            result.redraws += 1
            if again is None:
                break
            again_parts = shares(again, sizes)
            if grouped and not (again_parts and sound(again_parts, prints.values())):
                break
            for n, v in values(again_parts, float(again.square().sum())).items():
                draws[n].append(v)
    elif not grouped and parts:
        calibration.footprints[job[0][0]] = footprint(parts)
    for name, bits in job:
        value = robust_value(draws[name])
        if any(absurd(d, scale) for d in draws[name]):
            result.unsafe.append((name, bits))
            if record:
                calibration.mark_unsafe(name, bits)
        if not math.isfinite(value):
            continue
        if record:
            closed = calibration.closed_form(by_name[name], fallback_g2, bits)
            calibration.record(name, bits, value, closed, step)
        result.measured.append((name, bits, value))


def _distance(replayer: Replayer, model: torch.nn.Module, capture: Capture, choice: ChoiceFn, salt: int,
              exact_g: torch.Tensor, calibration: Calibration, result: ProbeResult) -> torch.Tensor | None:
    """The gradient difference of one replay from the exact one (None when it cannot run)."""
    g = _timed(calibration, result, _replay_fn(replayer, model, capture, choice, salt))
    return None if g is None else g - exact_g


def _uniform(by_name: dict[str, LayerState], bits: int, config: ControllerConfig) -> ChoiceFn:
    """A choice function: every calibrated layer at ``bits``, anything else exact."""
    def choice(name: str) -> tuple[float, float | None]:
        s = by_name.get(name)
        if s is None:
            return float(KEEP_BITS), None
        eb = error_bound_for(s, bits) if config.codec is CodecMode.ERRORBOUND else None
        return float(bits), eb

    return choice


def _replay_fn(replayer: Replayer, model: torch.nn.Module, capture: Capture, choice: ChoiceFn,
               seed: int) -> Callable[[], torch.Tensor | None]:
    return lambda: replayer.gradient(model, capture, choice, seed)


def _timed(calibration: Calibration, result: ProbeResult,
           fn: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
    t0 = time.perf_counter()
    out = fn()
    calibration.time_replay(time.perf_counter() - t0)
    result.replays += 1
    return out


def _batch(capture: Capture, dim: int) -> int | None:
    from memctl.controller.replay import flatten_tensors

    for t in flatten_tensors((capture.args, capture.kwargs)):
        if t is not None and t.dim() > dim:
            return int(t.shape[dim])
    return None
