"""``memctl demo``: train a real model on real data twice, plain and with memctl, and compare.

The data is scikit-learn's handwritten digits (1,797 8x8 images, shipped inside the
package, so nothing is downloaded). The model is a small residual CNN with BatchNorm,
in-place ReLU, max-pool and dropout, trained with Adam. The memctl run serves the HTTP
API while it trains, so ``memctl status`` and ``memctl budget`` work against it.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["LR_SCHEDULES", "DemoOptions", "DemoResult", "DigitsNet", "check_options", "run_demo"]


class DigitsNet(nn.Module):
    """A small residual CNN for 1x16x16 inputs (digits upsampled 2x)."""

    def __init__(self, width: int = 48, n_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        self.block = nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
        )
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.conv = nn.Sequential(
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
        )
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(2 * width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.pool(self.relu(self.block(x) + x))
        x = self.conv(x).mean(dim=(2, 3))
        return self.head(self.drop(x))


@dataclass(frozen=True)
class DemoOptions:
    steps: int = 300
    batch_size: int = 128
    budget: str | None = None
    bits: float = 2.0
    device: str = "auto"
    port: int = 0
    host: str = "127.0.0.1"
    out: str = "memctl-out"
    baseline: bool = True
    seed: int = 0
    progress: bool = True
    tensorboard: str | None = None
    lr_schedule: str = "cosine"
    """``"cosine"``: the learning rate decays from 2e-3 to 0 over the run (``CosineAnnealingLR``);
    ``"constant"``: it stays at 2e-3. At a constant rate the last steps' noise decides the final
    model: a run of plain PyTorch under a tiny gradient perturbation lands 8-21% from its own
    validation loss (benchmarks/convergence.py), so the two runs' accuracies, a few of 357 test
    images apart, say more about the last batches than about memctl."""
    warmup_steps: int = 0
    """The memctl run's first steps at 8 bits (``Controller(warmup_steps=...)``, NOTE [ Warm-up ])."""


LR_SCHEDULES = ("cosine", "constant")


LOSS_TAIL = 20
"""Steps averaged for the reported training loss (one batch's loss is noisy)."""


@dataclass
class RunResult:
    name: str
    train_loss_tail: float  # mean training loss over the last LOSS_TAIL steps (or all, if fewer)
    accuracy: float
    step_time_ms: float
    saved_raw_bytes: int
    saved_bytes: int
    losses: list[float] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


def ratio_vs_full(saved_raw: int, saved: int) -> float:
    """Saved bytes of the plain run over this run's: the one ratio the table and the bar show."""
    return saved_raw / max(saved, 1)


@dataclass
class DemoResult:
    device: str
    options: dict[str, Any]
    runs: list[RunResult]
    stats: dict[str, Any]
    url: str | None

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "options": self.options, "url": self.url,
                "runs": [asdict(r) for r in self.runs], "memctl_stats": self.stats}


def _pick_device(name: str) -> torch.device:
    from memctl.controller.device import resolve_device

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_device(name, nn.Module())


def check_options(opts: DemoOptions) -> torch.device:
    """Validate every option before any training starts; returns the device to train on.

    Raises:
        ConfigError: an option is out of range (a budget, bits, a device this machine lacks,
            a port outside [0, 65535], an output path that is not a directory).
        MemctlError: the port is already in use.
    """
    from memctl.controller.budget import parse_budget, resolve_budget
    from memctl.controller.config import ControllerConfig
    from memctl.controller.memory import device_total_bytes
    from memctl.errors import ConfigError

    if isinstance(opts.steps, bool) or not isinstance(opts.steps, int) or opts.steps < 1:
        raise ConfigError(f"--steps {opts.steps}: must be at least 1")
    if isinstance(opts.batch_size, bool) or not isinstance(opts.batch_size, int) or opts.batch_size < 1:
        raise ConfigError(f"--batch-size {opts.batch_size}: must be at least 1")
    if opts.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"--lr-schedule {opts.lr_schedule!r}: must be one of {', '.join(LR_SCHEDULES)}")
    try:
        ControllerConfig(bits=opts.bits)
    except ConfigError as exc:
        raise ConfigError(f"--bits {opts.bits:g}: {exc}") from None
    try:
        ControllerConfig(warmup_steps=opts.warmup_steps)
    except ConfigError as exc:
        raise ConfigError(f"--warmup-steps {opts.warmup_steps}: {exc}") from None
    device = _pick_device(opts.device)
    resolve_budget(parse_budget(opts.budget), device_total_bytes(device))
    if isinstance(opts.port, bool) or not isinstance(opts.port, int) or not 0 <= opts.port <= 65535:
        raise ConfigError(f"--port {opts.port}: must be in [0, 65535] (0 picks a free port)")
    if opts.port:
        _check_port_free(opts.host, opts.port)
    out = Path(opts.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {opts.out}: exists and is not a directory; choose another path")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--out {opts.out}: cannot create it ({exc.strerror or exc}); choose another path"
        ) from None
    return device


def _check_port_free(host: str, port: int) -> None:
    import socket

    from memctl.errors import MemctlError

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise MemctlError(
                f"--port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                "choose another port, or --port 0 for any free one"
            ) from None


def _digits(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = nn.functional.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = (x[perm] - 0.3) / 0.35, y[perm]
    split = 1440
    return x[:split].to(device), y[:split].to(device), x[split:].to(device), y[split:].to(device)


def _saved_bytes_plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of everything autograd saves for one plain step, parameters and buffers excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))
        if key[0] not in params and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total


def _train(opts: DemoOptions, device: torch.device, use_memctl: bool,
           announce: Any) -> tuple[RunResult, dict[str, Any], str | None]:
    import memctl

    torch.manual_seed(opts.seed)
    xtr, ytr, xte, yte = _digits(device)
    model = DigitsNet().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=opts.steps)
                if opts.lr_schedule == "cosine" else None)
    name = "memctl" if use_memctl else "baseline"
    ctl = None
    url = None
    saved_raw = _saved_bytes_plain(model, xtr[: opts.batch_size], ytr[: opts.batch_size])
    tb = None
    if use_memctl:
        ctl = memctl.Controller(model, opt, budget=opts.budget, bits=opts.bits,
                                warmup_steps=opts.warmup_steps)
        handle = ctl.serve(host=opts.host, port=opts.port)
        url = handle.url
        announce(f"memctl API and dashboard at {url}  (try: memctl status --url {url})")
        if opts.tensorboard is not None:
            from memctl.integrations.tensorboard import TensorBoardLogger

            tb = TensorBoardLogger(ctl, opts.tensorboard)
    g = torch.Generator().manual_seed(opts.seed + 1)
    losses: list[float] = []
    memory: list[int] = []
    bar = _progress(opts, name)
    warmup = min(5, opts.steps - 1)  # first steps compile kernels: not timed
    t0 = time.perf_counter()
    for i in range(opts.steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        idx = torch.randint(0, len(xtr), (opts.batch_size,), generator=g).to(device)
        loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if schedule is not None:
            schedule.step()
        losses.append(float(loss.detach()))
        if ctl is not None:
            s = ctl.stats()
            memory.append(int(s["packed_bytes"] + s["other_bytes"]))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", ratio=f"{ratio_vs_full(saved_raw, memory[-1]):.1f}x",
                            bits=f"{s['avg_bits']:.2f}")
        else:
            memory.append(saved_raw)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.update(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    bar.close()
    model.eval()
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean()) * 100
    stats: dict[str, Any] = {}
    saved = saved_raw
    events: list[dict[str, Any]] = []
    if ctl is not None:
        stats = ctl.stats()
        saved = memory[-1]  # the last step's, as the progress bar showed
        events = list(stats["events"])
        if tb is not None:
            tb.close()
        ctl.detach()
    tail = losses[-LOSS_TAIL:]
    result = RunResult(name=name, train_loss_tail=sum(tail) / len(tail), accuracy=acc,
                       step_time_ms=elapsed / (opts.steps - warmup) * 1e3, saved_raw_bytes=saved_raw,
                       saved_bytes=saved, losses=losses, memory=memory, events=events)
    return result, stats, url


def _progress(opts: DemoOptions, name: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=opts.steps, desc=f"{name:>8}", unit="step", disable=not opts.progress,
                file=sys.stderr, leave=True)


def _plot(result: DemoResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in result.runs:
        ax1.plot(run.losses, label=run.name, linewidth=1)
        ax2.plot([m / 2**20 for m in run.memory], label=run.name)
    ax1.set(title="training loss", xlabel="step", ylabel="cross-entropy")
    ax2.set(title="saved activations per step", xlabel="step", ylabel="MiB")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(result: DemoResult) -> str:
    rows = [("", *[r.name for r in result.runs])]
    rows.append(("saved activations", *[f"{r.saved_bytes / 2**20:.2f} MiB" for r in result.runs]))
    rows.append(("ratio vs full precision",
                 *[f"{ratio_vs_full(r.saved_raw_bytes, r.saved_bytes):.1f}x" for r in result.runs]))
    tail = min(LOSS_TAIL, min(len(r.losses) for r in result.runs))
    rows.append((f"train loss (mean of last {tail} steps)",
                 *[f"{r.train_loss_tail:.4f}" for r in result.runs]))
    rows.append(("test accuracy", *[f"{r.accuracy:.2f}%" for r in result.runs]))
    rows.append(("step time", *[f"{r.step_time_ms:.1f} ms" for r in result.runs]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_demo(opts: DemoOptions, out: Any = None) -> DemoResult:
    """Run the demo; prints progress, the URL and the comparison table; writes the report."""
    from memctl._extras import require

    require("demo", "memctl demo")
    if opts.tensorboard is not None:
        require("tensorboard", "memctl demo --tensorboard")
    stream = out if out is not None else sys.stdout

    def announce(msg: str) -> None:
        print(msg, file=stream, flush=True)

    device = check_options(opts)
    announce(f"memctl demo: digits CNN on {device}, {opts.steps} steps of batch {opts.batch_size}, "
             f"budget {opts.budget or 'none'} (average {opts.bits:g} bits"
             f"{f', the first {opts.warmup_steps} steps at 8' if opts.warmup_steps else ''}), "
             f"{opts.lr_schedule} learning rate")
    runs = []
    if opts.baseline:
        runs.append(_train(opts, device, use_memctl=False, announce=announce)[0])
    run, stats, url = _train(opts, device, use_memctl=True, announce=announce)
    runs.append(run)
    result = DemoResult(device=str(device), options=asdict(opts), runs=runs, stats=stats, url=url)
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(result.to_json(), indent=2, default=str))
    _plot(result, out_dir / "memory_loss.png")
    with (out_dir / "events.jsonl").open("w") as f:
        for event in run.events:
            f.write(json.dumps(event, default=str) + "\n")
    announce("")
    announce(_table(result))
    written = [out_dir / "report.json", out_dir / "memory_loss.png", out_dir / "events.jsonl"]
    announce(f"\nwrote {', '.join(map(str, written))}"
             + (f"; TensorBoard: tensorboard --logdir {opts.tensorboard}" if opts.tensorboard else ""))
    return result
