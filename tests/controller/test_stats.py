"""Per-layer statistics (memctl/controller/stats.py): one read-back per step."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import memctl
from memctl.controller import stats
from memctl.controller.calibration import Calibration
from memctl.controller.stats import LayerState, LayerStep, read_scalars
from tests.controller.models import CNN


def _step(seed: int, n: int) -> LayerStep:
    g = torch.Generator().manual_seed(seed)
    step = LayerStep()
    for _ in range(n):
        t = torch.randn(5, generator=g)
        step.mins.append(t.min())
        step.maxs.append(t.max())
        step.range_terms.append((t.double() ** 2).sum())
        step.grad_sq.append(t.float().square().sum())
    return step


def test_read_scalars_matches_reading_each_list() -> None:
    steps = [_step(0, 3), _step(1, 1), LayerStep()]
    rows = read_scalars(steps)
    for step, (vmin, vmax, range_sum, g2) in zip(steps[:2], rows[:2], strict=True):
        assert vmin == float(torch.stack(step.mins).min())
        assert vmax == float(torch.stack(step.maxs).max())
        # sums in another order (on the host: math.fsum) agree to the last bits
        assert range_sum == pytest.approx(float(torch.stack(step.range_terms).sum()), rel=1e-12)
        assert g2 == pytest.approx(float(torch.stack([g.double() for g in step.grad_sq]).sum()), rel=1e-12)
    assert all(math.isnan(v) for v in rows[2])


def test_read_scalars_takes_floats_and_keeps_torchs_nan() -> None:
    """Values already on the host (floats) mix with tensors; a NaN anywhere is the answer, as
    torch's reductions give it, whatever its place."""
    step = _step(0, 3)
    expected = read_scalars([step])[0]
    step.mins[1] = float(step.mins[1])
    step.range_terms[0] = float(step.range_terms[0])
    assert read_scalars([step])[0] == pytest.approx(expected, rel=1e-12)
    for place in range(3):
        nan = _step(0, 3)
        nan.maxs[place] = float("nan")
        nan.range_terms[place] = torch.tensor(float("nan"), dtype=torch.float64)
        _, vmax, range_sum, _ = read_scalars([nan])[0]
        assert math.isnan(vmax) and math.isnan(range_sum)


def test_the_device_path_reads_everything_back_in_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path of values on a GPU, run here on CPU tensors: the same rows as the host path, and
    one ``tolist`` for every layer's four lists, whatever their dtypes."""
    steps = [_step(0, 3), _step(1, 1), LayerStep(), _step(2, 2)]
    steps[3].mins[0] = float(steps[3].mins[0])  # a float among the tensors
    steps[3].grad_sq[1] = steps[3].grad_sq[1].to(torch.bfloat16)
    steps[1].maxs[0] = steps[1].maxs[0].reshape(1)  # a one-value tensor that is not 0-d
    on_host = read_scalars(steps)
    reads: list[int] = []
    tolist = torch.Tensor.tolist

    def counted(t: torch.Tensor) -> object:
        reads.append(t.numel())
        return tolist(t)

    monkeypatch.setattr(stats, "_on_host", lambda values: None)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    on_device = read_scalars(steps)
    assert len(reads) == 1
    for a, b in zip(on_host, on_device, strict=True):
        assert a == pytest.approx(b, rel=1e-12, nan_ok=True)
    nan = _step(0, 3)
    nan.maxs[1] = torch.tensor(float("nan"))
    assert math.isnan(read_scalars([nan])[0][1]) and not math.isnan(read_scalars([nan])[0][0])


def test_update_with_read_scalars_equals_update_alone() -> None:
    step = _step(3, 4)
    a, b = LayerState(name="a"), LayerState(name="b")
    a.update(step, batch=2, decay=0.9)
    b.update(step, batch=2, decay=0.9, scalars=read_scalars([step])[0])
    assert a == LayerState(**{**b.__dict__, "name": "a"})


def test_gradient_statistics_decay_per_step_not_per_reading() -> None:
    """NOTE [ Sparse gradient statistics ]: ‖∇Y‖² read at steps 0 and 9 only (steps 1-8 read
    none) keeps the first reading at 0.9⁹ of its weight, not 0.9."""
    state = LayerState(name="a")
    first = LayerStep()
    first.grad_sq.append(100.0)
    state.update(first, batch=1, decay=0.9)
    for _ in range(8):
        state.update(LayerStep(), batch=1, decay=0.9)
    assert state.ema_grad_sq == 100.0
    later = LayerStep()
    later.grad_sq.append(1.0)
    state.update(later, batch=1, decay=0.9)
    assert math.isclose(state.ema_grad_sq or 0.0, 0.9**9 * 100.0 + (1 - 0.9**9) * 1.0, rel_tol=1e-12)
    again = LayerStep()
    again.grad_sq.append(1.0)
    state.update(again, batch=1, decay=0.9)  # the next step: one step's decay
    expected = 0.9 * (0.9**9 * 100.0 + (1 - 0.9**9)) + 0.1
    assert math.isclose(state.ema_grad_sq or 0.0, expected, rel_tol=1e-12)
    assert LayerState.from_state_dict(state.state_dict()) == state


def test_range_statistics_decay_per_step_not_per_reading() -> None:
    """NOTE [ Range statistics on the steps that gather statistics ]: the range sum read at steps
    0 and 9 only keeps the first reading at 0.9⁹ of its weight, as ‖∇Y‖² does."""
    state = LayerState(name="a")
    first = LayerStep(mins=[0.0], maxs=[1.0], range_terms=[100.0])
    state.update(first, batch=1, decay=0.9)
    for _ in range(8):
        state.update(LayerStep(), batch=1, decay=0.9)
    assert state.ema_range_term == 100.0 and (state.vmin, state.vmax) == (0.0, 1.0)
    state.update(LayerStep(mins=[-2.0], maxs=[3.0], range_terms=[1.0]), batch=1, decay=0.9)
    assert math.isclose(state.ema_range_term or 0.0, 0.9**9 * 100.0 + (1 - 0.9**9) * 1.0, rel_tol=1e-12)
    assert (state.vmin, state.vmax) == (-2.0, 3.0)
    assert LayerState.from_state_dict(state.state_dict()) == state


class _Branchy(torch.nn.Module):
    """A conv net whose second branch runs at the steps in ``extra`` only."""

    def __init__(self, extra: set[int]) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.head = torch.nn.Linear(8 * 16 * 16, 10)
        self.extra, self.calls = extra, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if self.calls in self.extra:
            y = self.b(y * 2.0)  # (each layer saves a tensor of its own: ``b`` its input)
        self.calls += 1
        return self.head((y + 1.0).flatten(1))


def test_ranges_are_kept_on_the_steps_that_gather_statistics_and_on_a_layers_first() -> None:
    """NOTE [ Range statistics on the steps that gather statistics ]: with an allocation every 5
    steps, the steps 0, 1, 4, 5, 9, 10 and 14 keep range statistics; the branch first taken at
    step 2 keeps them there, and not at step 7."""
    torch.manual_seed(0)
    model = _Branchy({2, 7})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # head_bits=None: the head's input under the allocation's control, with its ranges
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0, allocation_interval=5,
                            calibration_fraction=0, min_numel=64, head_bits=None)
    seen: dict[str, list[int]] = {}
    fold = LayerState.fold

    def watch(self: LayerState, step: LayerStep, scalars: tuple[float, ...], *, decay: float) -> None:
        if step.range_terms:
            seen.setdefault(self.name, []).append(self.seen_steps - 1)
        fold(self, step, scalars, decay=decay)

    LayerState.fold = watch  # type: ignore[method-assign]
    try:
        for _ in range(15):
            x = torch.randn(8, 1, 16, 16)
            torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (8,))).backward()
            opt.step()
            opt.zero_grad()
        ctl.stats()  # folds the last step's
    finally:
        LayerState.fold = fold  # type: ignore[method-assign]
        ctl.detach()
    assert seen["head"] == [0, 1, 4, 5, 9, 10, 14], seen
    assert seen["b"] == [0], seen  # its own first step (the layer's second at step 7: none)


def _trained_cnn(steps: int) -> memctl.Controller:
    """The CNN at ``bits=2``, ``steps`` steps trained; its controller still attached."""
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0)
    for _ in range(steps):
        model(torch.randn(4, 1, 16, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    return ctl


def test_step_boundary_reads_back_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """NOTE [ One read-back per step ]: the controller folds every layer with one call."""
    calls: list[int] = []
    real = stats.start_read

    def counting(steps: list[LayerStep], *, defer: bool = False) -> stats.ScalarRead:
        calls.append(len(steps))
        return real(steps, defer=defer)

    monkeypatch.setattr(memctl.controller.controller, "start_read", counting)
    ctl = _trained_cnn(2)
    ctl.detach()
    assert len(calls) == 2 and all(n > 1 for n in calls)
    assert sum(la["max"] is not None for la in ctl.stats()["layers"]) >= 5


def test_read_back_takes_floats_beside_tensors_of_several_dtypes() -> None:
    """The device path (a GPU's values, read back once) takes floats beside tensors too."""
    got = stats._Copy([[torch.tensor(1.5), 2.25], [], [torch.tensor(-1.0, dtype=torch.float64),
                                                       torch.tensor([0.5], dtype=torch.bfloat16)]],
                      defer=False).lists()
    assert got == [[1.5, 2.25], [], [-1.0, 0.5]]
    assert stats._Copy([[3.0]], defer=False).lists() == [[3.0]]


@pytest.mark.parametrize("counts", [[7], [3, 1, 12], [1, 1]])
def test_segment_ranges_match_each_layers_own_reduction(counts: list[int]) -> None:
    """NOTE [ Range statistics ]: a device's layers folded together give each layer's own terms."""
    from memctl.controller.packing import _segment_ranges

    g = torch.Generator().manual_seed(len(counts))
    metas = []
    for c in counts:  # a layer's groups split over two records where it has several
        lo = torch.randn(c, generator=g)
        meta = torch.stack((lo, lo + torch.rand(c, generator=g) * 3), 1)
        metas.extend([meta] if c < 2 else [meta[:1], meta[1:]])
    terms, mins, maxs = _segment_ranges(metas, counts, 256)
    whole = torch.cat(metas).double()
    start = 0
    for j, c in enumerate(counts):
        part = whole[start:start + c]
        start += c
        span = part[:, 1] - part[:, 0]
        assert float(terms[j]) == pytest.approx(float((span * span).sum() * 256), rel=1e-12)
        assert float(mins[j]) == float(part[:, 0].min()) and float(maxs[j]) == float(part[:, 1].max())


def _run_cnn(steps: int, late: bool, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> tuple[Any, ...]:
    """``steps`` steps of the CNN; with ``late`` every read looks unfinished until it is waited
    for, as a GPU's copy does while the GPU is still a step behind."""
    if late:
        monkeypatch.setattr(stats.ScalarRead, "done", lambda self: False)
    # probes measure as many layers as their time budget allows: a fixed number here
    monkeypatch.setattr(Calibration, "affords", lambda self, train_s: True)
    monkeypatch.setattr(Calibration, "allowance", lambda self, train_s, fixed_replays, least=1: max(least, 3))
    torch.manual_seed(0)
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, **kwargs)
    seen: list[Any] = []
    g = torch.Generator().manual_seed(1)
    try:
        for i in range(steps):
            model(torch.randn(4, 1, 16, 16, generator=g)).sum().backward()
            opt.step()
            opt.zero_grad()
            if i % 4 == 1:
                layers = ctl.stats()["layers"]  # a read in the training thread folds first
                seen.append([(la["name"], la["min"], la["max"], la["sensitivity"], la["bits"])
                             for la in layers])
        state = ctl.state_dict()
    finally:
        ctl.detach()
        monkeypatch.undo()
    params = [p.detach().clone() for p in model.parameters()]
    return seen, state, params


def _timeless(state: Any) -> Any:
    """``state`` without its wall-clock figures (keys ending in ``_s`` or ``_ms``: solver and
    replay times)."""
    if isinstance(state, dict):
        return {k: _timeless(v) for k, v in state.items() if not str(k).endswith(("_s", "_ms"))}
    if isinstance(state, list | tuple):
        return [_timeless(v) for v in state]
    return state


@pytest.mark.parametrize("kwargs", [{"bits": 2}, {}, {"budget": 200_000},
                                    {"budget": 200_000, "calibration_fraction": 0.0}])
def test_statistics_folded_a_step_late_change_nothing(monkeypatch: pytest.MonkeyPatch,
                                                      kwargs: dict[str, Any]) -> None:
    """NOTE [ Statistics read a step late ]: with every read unfinished at its boundary, the
    statistics fold at the next boundary, or at once where a probe, the guard, an allocation or
    a read needs them. The run is the same to the bit: the same rows in ``stats()``, the same
    state, the same parameters (so the same allocations)."""
    now = _run_cnn(23, False, monkeypatch, **kwargs)
    late = _run_cnn(23, True, monkeypatch, **kwargs)
    assert now[0] == late[0]
    assert _timeless(now[1]) == _timeless(late[1])
    assert all(torch.equal(a, b) for a, b in zip(now[2], late[2], strict=True))


def test_a_late_read_is_folded_at_the_next_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two boundaries the step's statistics wait unfolded (no read of the training
    thread asked for them); the next boundary folds them before its own."""
    monkeypatch.setattr(stats.ScalarRead, "done", lambda self: False)
    ctl = _trained_cnn(3)
    try:
        assert ctl._unfolded is not None  # step 2 is not due: nothing needed it
        folded = {name: s.seen_steps for name, s in ctl._layers.items()}
        assert ctl.stats()["layers"] and ctl._unfolded is None
        assert all(ctl._layers[name].seen_steps == n for name, n in folded.items())
    finally:
        ctl.detach()
