"""memctl's own CPU cost per saved tensor and per step, independent of machine load.

Wall time on a shared machine says more about the neighbours than about memctl. This
benchmark measures CPU time of the training thread (``time.thread_time``) instead, with
torch and Numba at one thread (``torch.set_num_threads(1)``, ``NUMBA_NUM_THREADS=1``), so
that work done by other processes does not count and the training thread does all of the
work itself (on a CPU, autograd runs the backward in the calling thread). Each
configuration runs in its own process, on the models of ``benchmarks/training.py``:

- ``plain``: PyTorch as it is: forward, backward and optimizer step, each timed.
- ``memctl``: ``Controller(model, optimizer, bits=2, calibration_fraction=0)``, timed the
  same way, uninstrumented: the difference to ``plain`` is memctl's whole cost.
- ``memctl-phases``: the same, with the pack hook, the unpack hook and the step boundary
  (``Controller.step``) timed one by one, and inside them the codec kernels (the launchers
  in ``memctl/codecs/*/_kernels.py``, and ``channels.affine``: output allocation and the
  Numba call) timed apart.
  The cost of the timers themselves (two ``thread_time`` calls each) is measured and taken off.
  The kernels are also timed by launcher (quantize encode, decode and decode through a
  channel map, the channel maps of batch-norm chains, lossless pack and unpack,
  errorbound), and the region code work done in Python (the comparisons that build a
  code, the walk that finds the op that saved an input, the projection after decoding) apart:
  the "split" line, whose "everything else" is memctl's whole cost less those.
- ``memctl-probe``: ``Controller(model, optimizer, bits=2)`` with calibration on (the
  default), instrumented, for the cost of the calibration probes (NOTE [ Calibration ]): they
  run as often as a share (``calibration_fraction``) of the measured wall training time
  allows, so how many run depends on the machine's load; the other configurations turn them off.

It prints, per model: saved tensors per step (pack hook calls, and those compressed),
CPU ms per step of each configuration, and memctl's cost split into "codec kernels" and
"everything else", per saved tensor (pack and unpack hooks) and per step (the step
boundary, and the rest: module hooks, the backward's and optimizer's own work on what
memctl hands back, whatever is left of the total), and what the garbage collector took
(with the number of its full collections, ~0.1 s each, which dominate that figure).
The issue's target is "fixed per-step overhead ≤ 0.5 ms plus ≤ 20 µs per saved tensor
outside the codec kernels"; the summary line compares with 0.5 ms + 20 µs × tensors.

CPU time still moves with load on a shared machine (other processes evict the caches and
share the cores' execution units), by up to ±30% here at load 7-10: every configuration
runs ``--repeat`` times, interleaved, and the run with the least CPU time is reported.
"rest" is a difference between processes and carries their noise.

    python benchmarks/overhead.py                       # gru and mlp, 30 measured steps, 3 runs each
    python benchmarks/overhead.py --models gru,mlp,cnn --steps 50
    python benchmarks/overhead.py --profile gru         # cProfile of memctl's steps (one process)
    python benchmarks/overhead.py --calls gru           # function calls in one step (deterministic)
    python benchmarks/overhead.py --paired mlp          # memctl and plain stepped in turn in one process

``--paired MODEL`` measures the same in one process instead: two copies of the model
(the same weights), memctl attached to one, stepped in turn on the same batches, each
step's thread CPU time taken; memctl's cost is the difference of each pair of steps
(median and mean over the pairs), then the phases are timed as in ``memctl-phases`` over
as many pairs again. A third copy under ``torch.utils.checkpoint`` (every block, as
``training.py``'s ``checkpoint`` method) steps in the same turns of the first pass, for
the ratio of each to plain PyTorch. The models share the process's allocator, caches and
load from one step to the next, so the difference carries none of what separates two processes (the
``rest`` of the default mode is such a difference, and on a 4 ms step it moved by more than
memctl's whole cost); the phase figures are those of the same process. Calibration is off,
as in ``memctl``.

``--calls MODEL`` counts, with ``sys.setprofile``, the Python function calls and the calls
into C (builtins, torch's methods) that one steady-state training step makes with memctl
(``bits=2``, calibration off), after ``--warmup`` steps: the same count on every run and
every machine, so a change to the hot path can be compared where CPU times cannot resolve
it. It prints the totals, per saved tensor, and the functions called most.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import datetime
import gc
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

CONFIGS = ("plain", "memctl", "memctl-phases", "memctl-probe")
# memctl's cost by what it does (memctl-phases; outside the calibration probe): the kernel
# launchers by codec and direction, and the region code work in Python (NOTE [ Derivative regions ]).
SPLIT = ("quantize_encode", "quantize_decode", "quantize_decode_map", "channel_map", "lossless_pack",
         "lossless_unpack", "errorbound")
REGION = ("region_planes", "region_matches", "region_project")


def _thread_budget() -> None:
    """One thread for torch and Numba (Numba reads its variable at import)."""
    os.environ["NUMBA_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


class _Clock:
    """Accumulated thread CPU seconds and calls of one phase."""

    __slots__ = ("calls", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += clock() - start
                self.calls += 1

        return timed


def _timer_cost() -> float:
    """Seconds one ``_Clock.wrap`` adds around a call, measured here."""
    clock = _Clock()
    f = clock.wrap(lambda: None)
    n = 20000
    start = time.thread_time()
    for _ in range(n):
        f()
    wrapped = time.thread_time() - start
    start = time.thread_time()
    for _ in range(n):
        (lambda: None)()
    bare = time.thread_time() - start
    return max(wrapped - bare, 0.0) / n


def _instrument(controller: Any) -> dict[str, _Clock]:
    """Time the hooks, the step boundary, the probe and the kernel launchers (module docstring)."""
    from memctl.codecs import channels as ch
    from memctl.codecs.errorbound import _kernels as eb
    from memctl.codecs.lossless import _kernels as ll
    from memctl.codecs.quantize import _kernels as qz
    from memctl.controller import controller as controller_module
    from memctl.controller import regions

    phases = ("pack", "unpack", "probe")
    clocks = {name: _Clock() for name in (*phases, "step", *(f"kernels_{p}" for p in phases))}
    # A kernel counts for the phase it runs in: the pack hook, the unpack hook or the probe;
    # and, outside the probe, for its launcher (the split of SPLIT).
    inside = {"phase": "pack"}

    def kernel(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        timed = {p: clocks[f"kernels_{p}"].wrap(fn) for p in phases}
        clocks[label] = _Clock()
        split = clocks[label].wrap(lambda *args, **kwargs: timed[inside["phase"]](*args, **kwargs))

        def run(*args: Any, **kwargs: Any) -> Any:
            if inside["phase"] == "probe":
                return timed["probe"](*args, **kwargs)
            return split(*args, **kwargs)

        return run

    for module, names in ((qz, ("encode_cpu", "decode_cpu", "decode_affine_cpu")),
                          (ll, ("pack_cpu", "unpack_cpu")), (eb, ("run",)), (ch, ("affine",))):
        for name in names:
            label = {"encode_cpu": "quantize_encode", "decode_cpu": "quantize_decode",
                     "decode_affine_cpu": "quantize_decode_map", "affine": "channel_map",
                     "pack_cpu": "lossless_pack", "unpack_cpu": "lossless_unpack", "run": "errorbound"}[name]
            setattr(module, name, kernel(getattr(module, name), label))

    # Region code work outside the kernels (NOTE [ Derivative regions ]): the comparisons that
    # build a code (Partition.planes), the walk that finds who saved an input, the projection.
    def region(owner: Any, name: str) -> None:
        clocks[f"region_{name}"] = _Clock()
        fn = getattr(owner, name)
        if name == "planes":  # a generator: its work happens while it is consumed
            timed_list = clocks[f"region_{name}"].wrap(lambda *args, **kwargs: list(fn(*args, **kwargs)))

            def timed(*args: Any, **kwargs: Any) -> Any:
                return iter(timed_list(*args, **kwargs))
        else:
            timed = clocks[f"region_{name}"].wrap(fn)

        def run(*args: Any, **kwargs: Any) -> Any:
            if inside["phase"] == "probe":
                return getattr(owner, f"_plain_{name}")(*args, **kwargs)
            return timed(*args, **kwargs)

        setattr(owner, f"_plain_{name}", getattr(owner, name))
        setattr(owner, name, run)

    region(regions.Partition, "planes")
    region(regions.Partition, "project")
    region(regions.RegionTracker, "matches")

    hooks = {"pack": 0}  # pack hooks running (the default phase is "pack" too)

    def entering(phase: str, fn: Callable[..., Any], clock: str | None = None) -> Callable[..., Any]:
        timed = clocks[clock or phase].wrap(fn)

        def run(*args: Any, **kwargs: Any) -> Any:
            before, inside["phase"] = inside["phase"], phase
            depth = int(phase == "pack")
            hooks["pack"] += depth
            try:
                return timed(*args, **kwargs)
            finally:
                inside["phase"] = before
                hooks["pack"] -= depth

        return run

    scope, packer = controller._scope, controller._packer
    # The scope pushes these on autograd's stack when the window opens (first forward).
    scope._inner_pack, scope._unpack = entering("pack", packer.pack), entering("unpack", packer.unpack)
    # NOTE [ Packs queued in the forward ]: the queue is packed by a later pack hook, or when a
    # module's forward returns or the model's ends; the work done there counts as the pack hook's
    # (timed apart, "settle", so that the hook's calls still count the saved tensors)
    clocks["settle"] = _Clock()
    plain_settle = packer.settle
    timed_settle = entering("pack", plain_settle, "settle")
    packer.settle = lambda: plain_settle() if hooks["pack"] else timed_settle()
    controller.step = clocks["step"].wrap(controller.step)
    # The calibration probe (NOTE [ Calibration ]) replays the step inside the boundary with
    # hooks of its own: timed apart.
    controller_module.run_probe = entering("probe", controller_module.run_probe)
    return clocks


def _gc_clock() -> tuple[_Clock, _Clock]:
    """Thread CPU time of Python's cyclic garbage collector, which runs wherever allocations
    trigger it (with memctl mostly inside the hooks, which allocate the records): all of its
    passes, and the full (oldest-generation) ones apart, which traverse every tracked object
    in the process and come sooner the more objects survive into that generation."""
    clock, full, start = _Clock(), _Clock(), [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            start[0] = time.thread_time()
        else:
            spent = time.thread_time() - start[0]
            clock.seconds += spent
            clock.calls += 1
            if info.get("generation") == 2:
                full.seconds += spent
                full.calls += 1

    gc.callbacks.append(on_gc)
    return clock, full


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    _thread_budget()
    import torch
    from torch import nn

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from training import build

    torch.manual_seed(0)
    model, batch = build(args.model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    controller = clocks = None
    if args.config != "plain":
        from memctl import Controller

        # NOTE [ Calibration ] probes run as often as a share of the measured (wall) training
        # time allows, so their number differs between runs: off for the hot-path figures,
        # on (the default) in memctl-probe, which reports what they cost.
        calibration = {} if args.config == "memctl-probe" else {"calibration_fraction": 0.0}
        controller = Controller(model, optimizer, bits=2, **calibration)
        if args.config in ("memctl-phases", "memctl-probe"):
            clocks = _instrument(controller)
    gen = torch.Generator().manual_seed(1)
    loss_fn = nn.CrossEntropyLoss()
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": [], "total": []}
    marks: dict[str, float] = {}
    packs = packed = 0
    gc_clock, gc_full = _gc_clock()
    gc_seconds = gc_runs = gc_full_runs = 0
    clock = time.thread_time
    for step in range(args.warmup + args.steps):
        x, y = batch(gen)
        if step == args.warmup and clocks is not None:
            marks = {name: c.seconds for name, c in clocks.items()}
            marks.update({f"{name}_calls": c.calls for name, c in clocks.items()})
        if step == args.warmup:
            gc_seconds, gc_runs, gc_full_runs = gc_clock.seconds, gc_clock.calls, gc_full.calls
        if step == args.warmup and controller is not None:
            packs, packed = clocks["pack"].calls if clocks else 0, controller._packer.packs
        t0 = clock()
        out = loss_fn(model(x), y)
        t1 = clock()
        out.backward()
        t2 = clock()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = clock()
        if step >= args.warmup:
            phases["forward"].append(t1 - t0)
            phases["backward"].append(t2 - t1)
            phases["optimizer"].append(t3 - t2)
            phases["total"].append(t3 - t0)
    result: dict[str, Any] = {
        "model": args.model,
        "config": args.config,
        "steps": args.steps,
        **{f"{k}_ms": statistics.fmean(v) * 1e3 for k, v in phases.items()},
        "median_total_ms": statistics.median(phases["total"]) * 1e3,
        "gc_ms": (gc_clock.seconds - gc_seconds) / args.steps * 1e3,
        "gc_runs": (gc_clock.calls - gc_runs) / args.steps,
        "gc_full_runs": gc_full.calls - gc_full_runs,
    }
    if controller is not None:
        result["compressed_per_step"] = (controller._packer.packs - packed) / args.steps
    if clocks is not None:
        cost = _timer_cost()
        for name, c in clocks.items():
            calls = c.calls - marks[f"{name}_calls"]
            # timers nested inside another take their cost off the enclosing one
            inner = 0
            if name in ("pack", "unpack", "probe"):
                inner = clocks[f"kernels_{name}"].calls - marks[f"kernels_{name}_calls"]
            if name == "step":
                inner = sum(clocks[k].calls - marks[f"{k}_calls"] for k in ("probe", "kernels_probe"))
            if name in SPLIT:  # each holds the phase's kernel timer
                inner = calls
            result[f"{name}_calls"] = calls / args.steps
            result[f"{name}_ms"] = (c.seconds - marks[name] - cost * inner) / args.steps * 1e3
        # the first probe runs at step 0, inside the warm-up: the whole run's figure as well
        total = args.warmup + args.steps
        result["probe_calls_run"] = clocks["probe"].calls / total
        probe_s = clocks["probe"].seconds - cost * clocks["kernels_probe"].calls
        result["probe_ms_run"] = probe_s / total * 1e3
        result["saved_per_step"] = (clocks["pack"].calls - packs) / args.steps
        result["timer_us"] = cost * 1e6
    if controller is not None:
        controller.detach()
    return result


def _spawn(args: argparse.Namespace, model: str, config: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--config", config,
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"model": model, "config": config, "error": out.stderr.strip().splitlines()[-3:]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _report(model: str, runs: dict[str, dict[str, Any]]) -> None:
    plain, whole, ph, pr = runs["plain"], runs["memctl"], runs["memctl-phases"], runs["memctl-probe"]
    n = ph["saved_per_step"]
    pack = ph["pack_ms"] + ph.get("settle_ms", 0.0)  # with its queue packed outside the hook
    kernels = ph["kernels_pack_ms"] + ph["kernels_unpack_ms"]
    hooks_else = pack + ph["unpack_ms"] - kernels
    boundary = ph["step_ms"]
    overhead = whole["total_ms"] - plain["total_ms"]
    rest = overhead - pack - ph["unpack_ms"] - ph["step_ms"]
    outside = overhead - kernels
    target = 0.5 + 0.020 * n
    print(f"{model}: {n:.0f} saved tensors per step ({whole['compressed_per_step']:.0f} compressed); "
          f"CPU ms per step (mean, median): plain {plain['total_ms']:.2f} {plain['median_total_ms']:.2f}, "
          f"memctl {whole['total_ms']:.2f} {whole['median_total_ms']:.2f} "
          f"({whole['total_ms'] / plain['total_ms']:.2f}x), instrumented {ph['total_ms']:.2f}")
    print(f"  {'phase (CPU ms per step, mean)':<36} {'total':>8} {'kernels':>8} {'else':>8} "
          f"{'else us/t':>10}")

    def row(label: str, total: float, kern: float, per_tensor: bool = False) -> None:
        each = f"{(total - kern) / n * 1e3:>10.1f}" if per_tensor else ""
        print(f"  {label:<36} {total:>8.3f} {kern:>8.3f} {total - kern:>8.3f} {each}")

    row("pack hook (and its queue)", pack, ph["kernels_pack_ms"], True)
    row("unpack hook", ph["unpack_ms"], ph["kernels_unpack_ms"], True)
    row("step boundary (Controller.step)", boundary, 0.0)
    row("rest (module hooks, ...)", rest, 0.0)
    row("(garbage collector, in the above)", whole["gc_ms"] - plain["gc_ms"], 0.0)
    full = [r.get("gc_full_runs", "?") for r in (plain, whole, ph)]
    print(f"  (full collections in the {whole['steps']} measured steps: plain {full[0]}, memctl {full[1]}, "
          f"instrumented {full[2]})")
    row("memctl - plain (uninstrumented)", overhead, kernels)
    print(f"  outside the codec kernels: {outside:.3f} ms per step; target "
          f"0.5 + 0.020 x {n:.0f} = {target:.3f} ms: {'met' if outside <= target else 'missed'}. "
          f"Per saved tensor (hooks) {hooks_else / n * 1e3:.1f} us (target 20); "
          f"fixed (boundary + rest) {boundary + rest:.3f} ms (target 0.5)")
    split = {name: ph.get(f"{name}_ms", 0.0) for name in (*SPLIT, *REGION)}
    region = sum(split[r] for r in REGION)
    probe = pr["probe_ms"]
    other = overhead - sum(split[k] for k in SPLIT) - region
    kernels_split = ", ".join(f"{k.replace('_', ' ')} {split[k]:.1f} ({ph.get(f'{k}_calls', 0.0):.0f} calls)"
                              for k in SPLIT if split[k])
    print(f"  split (CPU ms per step): {kernels_split}, region codes in Python {region:.1f} (comparisons "
          f"{split['region_planes']:.1f}, walk {split['region_matches']:.1f}, projection "
          f"{split['region_project']:.1f}), everything else {other:.1f}; calibration probes "
          f"(calibration on) {probe:.1f}")
    print(f"  with calibration on (the default): probes {pr['probe_calls']:.2f} per step, "
          f"{pr['probe_ms']:.3f} ms per step (kernels {pr['kernels_probe_ms']:.3f}); "
          f"step boundary without them {pr['step_ms'] - pr['probe_ms']:.3f} ms; over the whole run "
          f"with the warm-up: {pr['probe_calls_run']:.2f} probes per step, {pr['probe_ms_run']:.3f} ms "
          f"per step")


def _training(name: str, **options: Any) -> tuple[Any, Callable[[int], None]]:
    """One thread, ``name``'s model of ``training.py`` under ``Controller(..., bits=2,
    **options)``: the controller and a function running that many training steps."""
    _thread_budget()
    import torch
    from torch import nn

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from training import build

    from memctl import Controller

    torch.manual_seed(0)
    model, batch = build(name)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    controller = Controller(model, optimizer, bits=2, **options)
    gen = torch.Generator().manual_seed(1)
    loss_fn = nn.CrossEntropyLoss()

    def train(steps: int) -> None:
        for _ in range(steps):
            x, y = batch(gen)
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return controller, train


def _profile(args: argparse.Namespace) -> None:
    _, train = _training(args.profile)
    train(args.warmup)
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    train(args.steps)
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)


def _calls(args: argparse.Namespace) -> None:
    """``--calls``: the function calls of one steady-state training step, counted."""
    controller, train = _training(args.calls, calibration_fraction=0)
    train(args.warmup)
    counts: collections.Counter[str] = collections.Counter()
    python = native = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal python, native
        if event == "call":
            python += 1
            code = frame.f_code
            counts[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1
        elif event == "c_call":
            native += 1
            counts[f"(C) {getattr(arg, '__qualname__', None) or repr(arg)}"] += 1

    sys.setprofile(count)
    try:
        train(1)
    finally:
        sys.setprofile(None)
    saved = counts["hooks.py:_pack_hook"]  # the pack hook's calls: one a saved tensor
    print(f"{args.calls}: one training step after {args.warmup}: {python} Python function calls, "
          f"{native} calls into C; {saved} saved tensors: {python / max(saved, 1):.1f} Python calls "
          f"and {native / max(saved, 1):.1f} calls into C a saved tensor")
    for name, n in counts.most_common(args.top):
        print(f"{n:8d}  {name}")
    controller.detach()


def _paired(args: argparse.Namespace) -> None:
    """``--paired MODEL``: memctl's cost as the difference of two copies of one model stepped in
    turn in one process (module docstring)."""
    _thread_budget()
    import copy

    import torch
    from torch import nn

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from training import build

    from memctl import Controller

    torch.manual_seed(0)
    model, batch = build(args.paired)
    twin = copy.deepcopy(model)  # before attaching: a copy of an attached model is plain anyway
    ckpt = copy.deepcopy(model)
    ckpt.checkpointed = True  # torch.utils.checkpoint around every block (training.py's method)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    twin_optimizer = torch.optim.Adam(twin.parameters(), lr=1e-3)
    ckpt_optimizer = torch.optim.Adam(ckpt.parameters(), lr=1e-3)
    controller = Controller(model, optimizer, bits=2, calibration_fraction=0.0)
    gen = torch.Generator().manual_seed(1)
    data = [batch(gen) for _ in range(8)]
    loss_fn = nn.CrossEntropyLoss()
    clock = time.thread_time

    def step(m: Any, opt: Any, x: Any, y: Any) -> None:
        loss_fn(m(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    checkpointed: list[float] = []

    def pairs(n: int, with_checkpoint: bool = False) -> tuple[list[float], list[float]]:
        mine, theirs = [], []
        for i in range(n):
            x, y = data[i % len(data)]
            t0 = clock()
            step(model, optimizer, x, y)
            t1 = clock()
            step(twin, twin_optimizer, x, y)
            t2 = clock()
            mine.append(t1 - t0)
            theirs.append(t2 - t1)
            if with_checkpoint:  # in the same turn, for issue 13's "faster than checkpointing"
                step(ckpt, ckpt_optimizer, x, y)
                checkpointed.append(clock() - t2)
        return mine, theirs

    pairs(args.warmup, with_checkpoint=True)
    checkpointed.clear()
    mine, theirs = pairs(args.steps, with_checkpoint=True)
    diffs = [a - b for a, b in zip(mine, theirs, strict=True)]
    clocks = _instrument(controller)
    pairs(args.warmup)  # the instrumented hooks are pushed when the next window opens
    marks = {name: (c.seconds, c.calls) for name, c in clocks.items()}
    pairs(args.steps)
    cost = _timer_cost()

    def per_step(name: str, inner: str | None = None) -> float:
        seconds, calls = clocks[name].seconds - marks[name][0], 0
        if inner is not None:
            calls = clocks[inner].calls - marks[inner][1]
        return (seconds - cost * calls) / args.steps * 1e3

    n = (clocks["pack"].calls - marks["pack"][1]) / args.steps
    pack = per_step("pack", "kernels_pack") + per_step("settle")
    unpack = per_step("unpack", "kernels_unpack")
    kernels = per_step("kernels_pack") + per_step("kernels_unpack")
    boundary = per_step("step")
    overhead = statistics.fmean(diffs) * 1e3
    rest = overhead - pack - unpack - boundary
    outside = overhead - kernels
    target = 0.5 + 0.020 * n
    print(f"{args.paired}: {n:.0f} saved tensors per step; CPU ms per step, {args.steps} pairs "
          f"(median, mean): plain {statistics.median(theirs) * 1e3:.3f} "
          f"{statistics.fmean(theirs) * 1e3:.3f}, memctl {statistics.median(mine) * 1e3:.3f} "
          f"{statistics.fmean(mine) * 1e3:.3f}; memctl - plain, "
          f"pair by pair: median {statistics.median(diffs) * 1e3:.3f}, mean {overhead:.3f}")
    plain_mean = statistics.fmean(theirs)
    print(f"  in the same turns (means): memctl {statistics.fmean(mine) / plain_mean:.2f}x plain, "
          f"torch.utils.checkpoint per block {statistics.fmean(checkpointed) * 1e3:.3f} ms "
          f"({statistics.fmean(checkpointed) / plain_mean:.2f}x)")
    print(f"  {'phase (CPU ms per step, mean)':<36} {'total':>8} {'kernels':>8} {'else':>8} "
          f"{'else us/t':>10}")
    for label, total, kern, each in (
            ("pack hook (and its queue)", pack, per_step("kernels_pack"), True),
            ("unpack hook", unpack, per_step("kernels_unpack"), True),
            ("step boundary (Controller.step)", boundary, 0.0, False),
            ("rest (module hooks, ...)", rest, 0.0, False),
            ("memctl - plain (mean of the pairs)", overhead, kernels, False)):
        tail = f"{(total - kern) / n * 1e3:>10.1f}" if each else ""
        print(f"  {label:<36} {total:>8.3f} {kern:>8.3f} {total - kern:>8.3f} {tail}")
    print(f"  outside the codec kernels: {outside:.3f} ms per step; target 0.5 + 0.020 x {n:.0f} = "
          f"{target:.3f} ms: {'met' if outside <= target else 'missed'}. Per saved tensor (hooks) "
          f"{(pack + unpack - kernels) / n * 1e3:.1f} us (target 20); fixed (boundary + rest) "
          f"{boundary + rest:.3f} ms (target 0.5)")
    controller.detach()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gru,mlp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration, the least loaded kept")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", metavar="MODEL", help="cProfile memctl's training steps on MODEL")
    parser.add_argument("--calls", metavar="MODEL",
                        help="count the function calls of one training step on MODEL (deterministic)")
    parser.add_argument("--paired", metavar="MODEL",
                        help="memctl and plain stepped in turn in one process: memctl's cost pair by pair")
    parser.add_argument("--top", type=int, default=40, help="--profile, --calls: functions shown")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return
    if args.profile:
        _profile(args)
        return
    if args.calls:
        _calls(args)
        return
    if args.paired:
        _paired(args)
        return
    import torch

    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"{now:%Y-%m-%d %H:%M} UTC, {_cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"1 thread (torch and Numba), {args.warmup} warm-up + {args.steps} measured steps, "
          f"thread CPU time, load {os.getloadavg()[0]:.2f}")
    for model in [m for m in args.models.split(",") if m]:
        # Interleaved repeats; each configuration's least-loaded run (smallest CPU time per
        # step) is reported whole: what other processes add to CPU time (cache and core
        # sharing) only ever adds, so the minimum is the estimate closest to an idle machine.
        tries: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
        for _ in range(args.repeat):
            for c in CONFIGS:
                tries[c].append(_spawn(args, model, c))
        failed = [r for rs in tries.values() for r in rs if "error" in r]
        if failed:
            for r in failed:
                print(f"{model} {r['config']}: failed: {r['error']}")
            continue
        runs = {c: min(rs, key=lambda r: float(r["total_ms"])) for c, rs in tries.items()}
        _report(model, runs)
    print(f"load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
