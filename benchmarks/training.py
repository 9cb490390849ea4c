"""Training side by side: plain PyTorch, memctl, activation checkpointing, CPU offloading.

Four models (a 4-block residual CNN, batch 32, 3x48x48; a 4-layer transformer LM, d 256,
seq 256, batch 16; a 2-layer GRU, seq 48; a 3-layer MLP, batch 64), and, when asked for with
``--models``, the GRU's shape with LSTM layers (``lstm``), torchvision's ResNet-18 (batch
32, 3x64x64, checkpointed per residual stage) and a 4-layer Hugging Face GPT-2 (d 256, seq
256, batch 8, checkpointed by transformers' own ``gradient_checkpointing_enable``), each
trained for a few steps with the same data and seed under each method, every (model, method)
pair in its own process:

- ``plain``: PyTorch as it is.
- ``memctl``: ``Controller(model, optimizer, bits=2)``, the default policy at 2 bits.
- ``memctl-default``: ``Controller(model, optimizer)``, the default (adaptive) policy: the
  fewest bytes within the variance bound (NOTE [ Default policy ]).
- ``memctl-budget``: the same with a memory budget: the model and optimizer state plus
  ``--budget-fraction`` of the activation memory plain PyTorch held (so the allocation
  chooses the bits per layer within it).
- ``checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around every block/layer.
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu``; on a CPU it only copies each saved
  tensor (there is nowhere to offload to), so it shows that copy's cost and saves nothing.

Memory is measured from outside memctl, as two figures. *Held*: what the forward leaves
allocated for the backward. *Peak*: the most allocated at any moment of the forward, which
is what runs out first: it also holds the forward's working set, the tensors an op reads
while it runs, which no saved-tensor hook can shrink. On the CPU, from the process's
resident set (``/proc/self/statm``; the peak from ``VmHWM`` in ``/proc/self/status``,
restarted before each forward through ``/proc/self/clear_refs``), from just before the
forward pass to just before the backward pass, with ``MALLOC_MMAP_THRESHOLD_=4096`` (the page
size) in the child's environment so that every tensor buffer of a page or more is a mapping
of its own and leaves the resident set when freed (and glibc's ``malloc_trim(0)`` before
each forward, outside the timed region, for the small blocks below that threshold). With
the threshold at 64 KiB, as until 2026-11-24, the GRU's 16 KiB tensors came from glibc's
heap, whose top the long-lived blocks between them pinned: plain 12.2 MiB held, memctl
8.3 MiB, checkpointing 5.3 MiB; at 4 KiB 13.2, 1.8 and 4.0 MiB (the CNN's and MLP's
figures move by less than 0.2 MiB); on a GPU, ``torch.cuda.memory_allocated`` after the forward and
``torch.cuda.max_memory_allocated`` during it, each minus the memory allocated before it.
``--scale`` multiplies every batch size: a GPU needs larger batches than a CPU to be busy.
Step time is the median over the measured steps after warm-up (forward, backward and
optimizer step), and their mean: memctl's calibration probes (NOTE [ Probe cost ]) run
inside the optimizer step of a few steps, so the median leaves them out and the mean
carries them, with the number of probes that ran in the measured steps (``probes``, summed
over the rounds). The first probe runs at step 0, in the warm-up; while layers are
unmeasured the probes may take a quarter of the time trained, a twentieth afterwards, so
only runs of many steps (``--steps 100``) show what a long run pays. On a GPU the steps
are timed as a training loop that does not wait for the GPU runs them (its own process: the
batches on the device beforehand, no synchronisation or read-back inside the measured steps,
an event on the stream at each step's start; a step's time is the period between two
events on the GPU's timeline), and ``synced ms`` is the median step of the memory process,
which waits for the GPU before and after each step and after each forward (each step alone,
from an idle GPU: the CPU's time and the GPU's add up there). Loss is the last step's.
With ``--rounds N`` every configuration is timed in N processes, the methods in
turns (plain, memctl, ..., plain, memctl, ...), and the table gives the median of the N
and their range: on a shared machine whose speed drifts over minutes, one process per
method compared methods timed minutes apart. ``--threads N`` sets ``OMP_NUM_THREADS`` and
``NUMBA_NUM_THREADS`` in the child processes.

    python benchmarks/training.py                    # all models and methods, CPU
    python benchmarks/training.py --quick            # fewer steps
    python benchmarks/training.py --threads 1 --rounds 3 --models cnn,transformer
    python benchmarks/training.py --device cuda --models cnn,transformer --scale 8
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODELS = ("cnn", "transformer", "gru", "mlp")
EXTRA = ("lstm",)
"""Models of this file run only when asked for (``--models lstm``)."""
EXTERNAL = ("resnet18", "gpt2")
"""Models from torchvision and transformers, run when asked for (``--models resnet18,gpt2``)."""
METHODS = ("plain", "memctl", "memctl-default", "memctl-budget", "checkpoint", "save_on_cpu")


# -- models --------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class _Chain(nn.Module):
    """Stem, a list of blocks (checkpointed one by one when asked), head."""

    def __init__(self, stem: nn.Module, blocks: list[nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.stem = stem
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.checkpointed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)  # type: ignore[no-any-return]


class _CausalLayer(nn.Module):
    def __init__(self, d: int, seq: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, src_mask=self.mask, is_causal=True)  # type: ignore[no-any-return]


class _RecurrentLayer(nn.Module):
    def __init__(self, kind: type[nn.GRU] | type[nn.LSTM], d_in: int, d: int) -> None:
        super().__init__()
        self.rnn = kind(d_in, d, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]  # type: ignore[no-any-return]


class _Last(nn.Module):
    def __init__(self, d: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x[:, -1])  # type: ignore[no-any-return]


Batch = Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def build(name: str, scale: int = 1) -> tuple[_Chain | _External, Batch]:
    """The model and a function drawing one batch ``(input, target)``, of ``scale`` times the batch size."""
    if name == "cnn":
        c = 32
        model = _Chain(
            nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()),
            [_Block(c) for _ in range(4)],
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10)),
        )
        return model, lambda g: (torch.randn(32 * scale, 3, 48, 48, generator=g),
                                 torch.randint(0, 10, (32 * scale,), generator=g))
    if name == "transformer":
        d, seq, vocab = 256, 256, 1000
        model = _Chain(
            nn.Embedding(vocab, d),
            [_CausalLayer(d, seq) for _ in range(4)],
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab), nn.Flatten(0, 1)),
        )
        return model, lambda g: (torch.randint(0, vocab, (16 * scale, seq), generator=g),
                                 torch.randint(0, vocab, (16 * scale * seq,), generator=g))
    if name == "gru":
        d, seq = 128, 48
        model = _Chain(nn.Linear(32, d), [_RecurrentLayer(nn.GRU, d, d) for _ in range(2)], _Last(d, 10))
        return model, lambda g: (torch.randn(32 * scale, seq, 32, generator=g),
                                 torch.randint(0, 10, (32 * scale,), generator=g))
    if name == "lstm":  # the GRU's shape with LSTM layers (a float32 CPU LSTM runs on oneDNN)
        d, seq = 128, 48
        model = _Chain(nn.Linear(32, d), [_RecurrentLayer(nn.LSTM, d, d) for _ in range(2)], _Last(d, 10))
        return model, lambda g: (torch.randn(32 * scale, seq, 32, generator=g),
                                 torch.randint(0, 10, (32 * scale,), generator=g))
    if name == "mlp":
        model = _Chain(
            nn.Flatten(),
            [nn.Sequential(nn.Linear(784 if i == 0 else 512, 512), nn.ReLU()) for i in range(2)],
            nn.Linear(512, 10),
        )
        return model, lambda g: (torch.randn(64 * scale, 784, generator=g),
                                 torch.randint(0, 10, (64 * scale,), generator=g))
    if name in EXTERNAL:
        return _external(name, scale)
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS + EXTRA + EXTERNAL)}")


class _Checkpointed(nn.Module):
    """A block run under ``torch.utils.checkpoint`` when ``on`` (the ``checkpoint`` method)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False) if self.on else self.inner(x)  # type: ignore[no-any-return]


class _External(nn.Module):
    """A torchvision or transformers model behind :class:`_Chain`'s interface: logits out, and
    ``checkpointed`` switching checkpointing per residual stage (ResNet) or per layer
    (transformers' own ``gradient_checkpointing_enable``)."""

    def __init__(self, model: nn.Module, stages: list[_Checkpointed], lm: bool) -> None:
        super().__init__()
        self.model = model
        self.stages = stages
        self.lm = lm

    @property
    def checkpointed(self) -> bool:
        return any(s.on for s in self.stages) or bool(getattr(self.model, "is_gradient_checkpointing", False))

    @checkpointed.setter
    def checkpointed(self, on: bool) -> None:
        for s in self.stages:
            s.on = on
        if self.lm and on:
            self.model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs={"use_reentrant": False})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm:
            return self.model(input_ids=x).logits.flatten(0, 1)  # type: ignore[no-any-return]
        return self.model(x)  # type: ignore[no-any-return]


def _external(name: str, scale: int) -> tuple[_External, Batch]:
    """ResNet-18 (batch 32, 3x64x64) or a 4-layer GPT-2 (d 256, seq 256, batch 8), times ``scale``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fidelity  # handles a torchvision built for another torch, and transformers' import of it

    if name == "resnet18":
        model = fidelity.import_torchvision_models().resnet18(num_classes=10)
        stages = []
        for stage in ("layer1", "layer2", "layer3", "layer4"):
            wrapped = _Checkpointed(getattr(model, stage))
            setattr(model, stage, wrapped)
            stages.append(wrapped)
        return _External(model, stages, lm=False), lambda g: (
            torch.randn(32 * scale, 3, 64, 64, generator=g), torch.randint(0, 10, (32 * scale,), generator=g))
    fidelity.prepare_torchvision()
    from transformers import GPT2Config, GPT2LMHeadModel

    seq, vocab = 256, 1000
    lm = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=vocab, n_positions=seq,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return _External(lm, [], lm=True), lambda g: (
        torch.randint(0, vocab, (8 * scale, seq), generator=g),
        torch.randint(0, vocab, (8 * scale * seq,), generator=g))


# -- one configuration (child process) --------------------------------------------------------
def _trim() -> None:
    """Return freed heap pages to the system (glibc), so the next forward's growth shows in RSS."""
    # Not glibc: small freed blocks stay resident and the figure is a lower bound.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Restart the kernel's peak resident set (``VmHWM``) from the current one (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, batch = build(args.model, args.scale)
    model.to(device)
    model.checkpointed = args.method == "checkpoint"
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    controller = None
    if args.method.startswith("memctl"):
        from memctl import Controller

        budget = args.budget_bytes if args.method == "memctl-budget" else None
        bits = None if args.method == "memctl-default" else 2
        controller = Controller(model, optimizer, bits=bits, budget=budget)
    gen = torch.Generator().manual_seed(1)
    loss_fn = nn.CrossEntropyLoss()
    times: list[float] = []
    held: list[int] = []
    peaks: list[int] = []
    loss = float("nan")
    cuda = device.type == "cuda"
    probes = 0
    if cuda and args.phase == "time":
        result = _time_on_gpu(args, model, optimizer, controller, batch, gen, loss_fn)
        result["state_bytes"] = _state_bytes(model, optimizer)
        if controller is not None:
            controller.detach()
        return result
    for step in range(args.warmup + args.steps):
        if step == args.warmup and controller is not None:
            probes = -controller.stats()["calibration"]["probes"]
        x, y = (t.to(device) for t in batch(gen))
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        elif args.phase == "memory":
            _trim()
            base = _rss()
            peaked = _reset_peak_rss()
        start = time.perf_counter()
        if args.method == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=cuda):
                out = loss_fn(model(x), y)
        else:
            out = loss_fn(model(x), y)
        if cuda:
            torch.cuda.synchronize()
            grown = torch.cuda.memory_allocated() - base
            peak = torch.cuda.max_memory_allocated() - base
        elif args.phase == "memory":
            grown = _rss() - base
            peak = _peak_rss() - base if peaked else 0
        else:
            grown = peak = 0
        out.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        loss = float(out.detach())
        if step >= args.warmup:
            times.append(elapsed)
            held.append(grown)
            peaks.append(peak)
    result = {
        "model": args.model,
        "method": args.method,
        "step_ms": statistics.median(times) * 1e3,
        "mean_ms": statistics.fmean(times) * 1e3,
        "held_bytes": statistics.median(held),
        "peak_bytes": statistics.median(peaks),
        "loss": loss,
        "state_bytes": _state_bytes(model, optimizer),
    }
    if controller is not None:
        result["probes"] = probes + controller.stats()["calibration"]["probes"]
        controller.detach()
    return result


def _time_on_gpu(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
                 controller: Any, batch: Callable[[torch.Generator], tuple[torch.Tensor, ...]],
                 gen: torch.Generator, loss_fn: nn.Module) -> dict[str, Any]:
    """Step times on a GPU as a training loop that does not wait for it runs: the batches on the
    device before the first step, no synchronisation and no read-back inside the measured steps,
    an event recorded on the stream as each step starts. The times between consecutive events
    are the steps' periods on the GPU's timeline: with the CPU ahead they are the GPU's own
    time, with the CPU behind they include the GPU's idle wait for it."""
    device = torch.device(args.device)
    data = [tuple(t.to(device) for t in batch(gen)) for _ in range(args.warmup + args.steps)]
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    probes = 0
    out = torch.zeros(())
    for step, (x, y) in enumerate(data):
        if step == args.warmup:
            torch.cuda.synchronize()
            if controller is not None:
                probes = -controller.stats()["calibration"]["probes"]
        if step >= args.warmup:
            marks[step - args.warmup].record()
        out = loss_fn(model(x), y)
        out.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    marks[-1].record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    result: dict[str, Any] = {
        "model": args.model, "method": args.method, "step_ms": statistics.median(times),
        "mean_ms": statistics.fmean(times), "held_bytes": 0, "peak_bytes": 0, "loss": float(out.detach()),
    }
    if controller is not None:
        result["probes"] = probes + controller.stats()["calibration"]["probes"]
    return result


# -- the table (parent process) -----------------------------------------------------------------
_MMAP_THRESHOLD = 4096
"""glibc's mmap threshold in the memory process: every buffer of a page or more is its own mapping."""


def _spawn(args: argparse.Namespace, model: str, method: str, budget: int | None) -> dict[str, Any]:
    """One configuration, in two processes. On a CPU, RSS shows held memory only with
    ``MALLOC_MMAP_THRESHOLD_=4096`` (freed tensors leave RSS), but that setting turns every
    allocation of a page or more into an mmap with fresh page faults (at 64 KiB it already
    slowed the CNN's plain step 1.5x and memctl's 1.9x). So the step time comes from a
    process with the allocator as users run it, the memory from one with the setting. On a
    GPU the memory process waits for the GPU around each forward to read the allocator's
    figures; the timing process waits for nothing (:func:`_time_on_gpu`)."""
    timed = _run(args, model, method, budget, "time")
    if "error" in timed:
        return timed
    held = _run(args, model, method, budget, "memory")
    if "error" in held:
        return held
    timed["held_bytes"], timed["state_bytes"] = held["held_bytes"], held["state_bytes"]
    timed["peak_bytes"] = held["peak_bytes"]
    if args.device.startswith("cuda"):  # each step alone, the GPU drained before and after it
        timed["synced_ms"] = held["step_ms"]
    return timed


def _run(args: argparse.Namespace, model: str, method: str, budget: int | None, phase: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--method", method,
           "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--phase", phase, "--scale", str(args.scale)]
    if budget is not None:
        cmd += ["--budget-bytes", str(budget)]
    env = dict(os.environ)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = env["NUMBA_NUM_THREADS"] = str(args.threads)
    if phase == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = str(_MMAP_THRESHOLD)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"model": model, "method": method, "error": out.stderr.strip().splitlines()[-1:]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="3 warm-up and 5 measured steps")
    parser.add_argument("--scale", type=int, default=1,
                        help="batch sizes times this (a GPU needs a larger batch than a CPU to be busy)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every configuration this many times, in turns, and report the median "
                             "(a machine whose speed drifts moves all methods alike within a round)")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS and NUMBA_NUM_THREADS of the child processes (default: as set)")
    parser.add_argument("--budget-fraction", type=float, default=0.125,
                        help="memctl-budget: activation share of plain's held memory (default 1/8)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=("time", "memory"), default="memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return
    if args.quick:
        args.steps, args.warmup = 5, 3
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False here")
    methods = [m for m in args.methods.split(",") if m]
    if "memctl-budget" in methods and "plain" not in methods:
        methods.insert(0, "plain")
    if args.scale < 1:
        raise SystemExit(f"--scale {args.scale}: give a whole number >= 1")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give a whole number >= 1")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"--threads {args.threads}: give a whole number >= 1")
    gpu = f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""
    print(f"device {args.device}{gpu}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{args.warmup} warm-up + {args.steps} measured steps, batch x{args.scale}, "
          f"{args.threads or os.environ.get('OMP_NUM_THREADS', 'default')} threads, "
          f"{args.rounds} round{'s' if args.rounds > 1 else ''}, load {os.getloadavg()[0]:.2f}")
    spread = args.rounds > 1
    gpu_synced = args.device.startswith("cuda")
    print(f"{'model':<12} {'method':<14} {'step ms':>9} {'x plain':>8} {'mean ms':>9} {'x plain':>8} "
          f"{'probes':>6} {'held MiB':>9} {'less':>7} {'peak MiB':>9} {'less':>7} {'loss':>8}"
          + (f" {'synced ms':>9} {'x plain':>8}" if gpu_synced else "")
          + (f" {'step ms, rounds':>17}" if spread else ""))
    for model in [m for m in args.models.split(",") if m]:
        results: dict[str, dict[str, Any]] = {}
        budgets: dict[str, int | None] = {}
        for method in methods:
            budget = None
            if method == "memctl-budget":
                plain = results.get("plain")
                if plain is None or "error" in plain:
                    continue
                budget = int((plain["state_bytes"] + args.budget_fraction * plain["held_bytes"]) / 0.9)
            budgets[method] = budget
            r = _spawn(args, model, method, budget)
            r["rounds"] = [r["step_ms"]] if "error" not in r else []
            r["means"] = [r["mean_ms"]] if "error" not in r else []
            results[method] = r
        for _ in range(args.rounds - 1):  # the methods in turns, timed only
            for method, budget in budgets.items():
                if "error" not in results[method]:
                    again = _run(args, model, method, budget, "time")
                    if "error" not in again:
                        results[method]["rounds"].append(again["step_ms"])
                        results[method]["means"].append(again["mean_ms"])
                        if "probes" in again:
                            results[method]["probes"] += again["probes"]
        plain = results.get("plain")
        if plain is not None and "error" not in plain:
            plain["step_ms"] = statistics.median(plain["rounds"])
            plain["mean_ms"] = statistics.median(plain["means"])
        for method, r in results.items():
            if "error" in r:
                print(f"{model:<12} {method:<14} failed: {r['error']}")
                continue
            r["step_ms"] = statistics.median(r["rounds"])
            r["mean_ms"] = statistics.median(r["means"])
            ok = plain is not None and "error" not in plain
            ratio = r["step_ms"] / plain["step_ms"] if ok and plain is not None else float("nan")
            mean_ratio = r["mean_ms"] / plain["mean_ms"] if ok and plain is not None else float("nan")
            probes = str(r["probes"]) if "probes" in r else "-"
            less = _less(plain if ok else None, r, "held_bytes")
            peak_less = _less(plain if ok else None, r, "peak_bytes")
            rounds = f" {min(r['rounds']):>8.2f}-{max(r['rounds']):<8.2f}" if spread else ""
            synced = ""
            if gpu_synced:
                base = plain.get("synced_ms", math.nan) if ok and plain is not None else math.nan
                synced = f" {r.get('synced_ms', math.nan):>9.2f} {r.get('synced_ms', math.nan) / base:>8.2f}"
            print(f"{model:<12} {method:<14} {r['step_ms']:>9.2f} {ratio:>8.2f} {r['mean_ms']:>9.2f} "
                  f"{mean_ratio:>8.2f} {probes:>6} {r['held_bytes'] / 2**20:>9.2f} {less} "
                  f"{r['peak_bytes'] / 2**20:>9.2f} {peak_less} "
                  f"{r['loss']:>8.4f}{synced}{rounds}", flush=True)
    print(f"load at the end {os.getloadavg()[0]:.2f}")


def _less(plain: dict[str, Any] | None, r: dict[str, Any], key: str) -> str:
    """How many times less than plain, or n/a below a few pages (the ratio says nothing)."""
    if plain is None or r[key] < 2**16:
        return "    n/a"
    return f"{plain[key] / r[key]:>6.1f}x"


if __name__ == "__main__":
    main()
