"""Train a small CNN on CIFAR-shaped synthetic images with memctl managing activation memory.

Everything a training job does with memctl, in one script (nothing is downloaded):

1. attach a :class:`memctl.Controller` with a device-memory budget to the model and optimizer;
2. serve its HTTP API (``ctl.serve``) so ``memctl status`` / ``curl`` / Prometheus can watch;
3. draw batches with :class:`memctl.AdaptiveBatchSampler`, which follows ``ctl.batch_size``;
4. run each optimizer step through ``ctl.guarded_step`` (splits the batch on out-of-memory);
5. print ``ctl.stats()`` every few steps and change the budget mid-run with ``ctl.set_budget``;
6. save ``ctl.state_dict()`` in the checkpoint beside the model and optimizer, restore it in a
   fresh process-like setup and train on;
7. ``ctl.detach()``: the model is plain PyTorch again.

Run it (CPU, about half a minute, most of it Numba compiling the codec kernels once)::

    python examples/train_cifar_like.py --steps 30 --device cpu --port 8765

and, while it runs, from another shell::

    memctl status --url http://127.0.0.1:8765
    memctl budget 6MiB --url http://127.0.0.1:8765

Binding the API to anything but loopback (``--host 0.0.0.0``, as in a container) needs a
bearer token for ``PUT /v1/budget``: set ``MEMCTL_TOKEN`` in the environment.
The default budgets are sized for this tiny model; on a GPU try ``--budget 75%``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import memctl
from memctl.controller.budget import format_bytes

N_CLASSES = 10


class SmallCNN(nn.Module):
    """Conv-BN-ReLU stages with pooling and a linear head: the usual CIFAR layout, shrunk."""

    def __init__(self, width: int = 16, n_classes: int = N_CLASSES) -> None:
        super().__init__()

        def stage(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)
            )

        self.features = nn.Sequential(
            stage(3, width), stage(width, width), nn.MaxPool2d(2),
            stage(width, 2 * width), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def make_dataset(n: int, image_size: int, seed: int) -> TensorDataset:
    """CIFAR-shaped data (3 x size x size, 10 classes): a smooth pattern per class plus noise."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(N_CLASSES, 3, 4, 4, generator=g)
    prototypes = nn.functional.interpolate(coarse, size=(image_size, image_size), mode="bilinear",
                                           align_corners=False)
    labels = torch.randint(0, N_CLASSES, (n,), generator=g)
    images = prototypes[labels] + 0.8 * torch.randn(n, 3, image_size, image_size, generator=g)
    return TensorDataset(images, labels)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps before the checkpoint (30)")
    p.add_argument("--device", default="auto", help="'auto' (a GPU if there is one), 'cpu' or 'cuda[:N]'")
    p.add_argument("--budget", default="8MiB",
                   help="device-memory budget: '8MiB', '12GiB', '75%%', bytes, or 'none' (8MiB)")
    p.add_argument("--new-budget", default="4MiB",
                   help="budget set with ctl.set_budget at --change-at ('none' keeps the first) (4MiB)")
    p.add_argument("--change-at", type=int, default=None, help="step of the budget change (--steps / 2)")
    p.add_argument("--host", default="127.0.0.1", help="API address; non-loopback needs MEMCTL_TOKEN")
    p.add_argument("--port", type=int, default=8765, help="API port, 0 for any free one (8765)")
    p.add_argument("--no-serve", action="store_true", help="do not start the HTTP API")
    p.add_argument("--batch-size", type=int, default=32, help="batch size until the controller has one (32)")
    p.add_argument("--max-batch-size", type=int, default=128, help="largest batch memctl may choose (128)")
    p.add_argument("--image-size", type=int, default=16, help="image height and width (16; CIFAR: 32)")
    p.add_argument("--samples", type=int, default=2048, help="synthetic training images (2048)")
    p.add_argument("--log-every", type=int, default=5, help="print ctl.stats() every N steps (5)")
    p.add_argument("--checkpoint", default=None, help="checkpoint path (default: a temporary directory)")
    p.add_argument("--resume", default=None, help="start from this checkpoint (model, optimizer, memctl)")
    p.add_argument("--resume-steps", type=int, default=3,
                   help="steps trained after restoring the saved checkpoint into fresh objects (3)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "max_batch_size", "image_size", "samples", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.image_size % 4:
        p.error(f"--image-size {args.image_size}: must be a multiple of 4 (two 2x2 poolings)")
    return args


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch.cuda.is_available() is False on this machine")
    return device


def _budget(text: str | None) -> str | None:
    return None if text is None or text.lower() in ("none", "null") else text


def build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer,
                                                                    memctl.Controller]:
    """A fresh model, optimizer and controller (the controller attaches hooks; nothing is replaced)."""
    torch.manual_seed(args.seed)
    model = SmallCNN().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # min/max_batch_size bound what ctl.batch_size may recommend; any ControllerConfig
    # field can be passed this way (e.g. bits=2.0, allocation_interval=10).
    ctl = memctl.Controller(model, optimizer, budget=_budget(args.budget), device=device,
                            min_batch_size=8, max_batch_size=args.max_batch_size)
    return model, optimizer, ctl


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    ctl: memctl.Controller, step: int) -> None:
    """The controller's state (bits, layer statistics, budget, step) travels with the model's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "memctl": ctl.state_dict()}, path)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    ctl: memctl.Controller, device: torch.device) -> int:
    """Restore all three; returns the step the checkpoint was taken at."""
    state = torch.load(path, map_location=device, weights_only=True)  # plain containers only
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    ctl.load_state_dict(state["memctl"])
    return int(state["step"])


def stats_line(ctl: memctl.Controller, loss: float, batch: int) -> str:
    s = ctl.stats()
    return (f"step {s['step']:>4}  loss {loss:.3f}  batch {batch:>3} (next {ctl.batch_size})  "
            f"activations {format_bytes(s['raw_bytes'])} -> {format_bytes(s['packed_bytes'])} "
            f"(ratio {s['ratio']:.1f}x, {s['avg_bits']:.2f} bits/value)  budget {_budget_text(s)}")


def _budget_text(s: dict[str, Any]) -> str:
    return format_bytes(s["budget_bytes"])  # "none" without a budget


def train(ctl: memctl.Controller, model: nn.Module, dataset: TensorDataset, device: torch.device,
          args: argparse.Namespace, steps: int, first_step: int = 0) -> float:
    """``steps`` optimizer steps; returns the last loss."""
    # Each batch takes ctl.batch_size samples at the moment it is cut; with num_workers=0 that
    # is the size after the previous step. Every sample is still seen once per epoch.
    sampler = memctl.AdaptiveBatchSampler(dataset, ctl, batch_size=args.batch_size, seed=args.seed)
    loader = DataLoader(dataset, batch_sampler=sampler)
    change_at = args.change_at if args.change_at is not None else max(args.steps // 2, 1)

    def compute_loss(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)  # a mean over the (micro-)batch

    loss, done = float("nan"), 0
    while done < steps:
        for x, y in loader:
            # guarded_step = zero_grad + forward + backward + optimizer.step, retried as
            # micro-batches on torch.OutOfMemoryError. The optimizer's step post-hook
            # advances the controller; a plain loss.backward(); optimizer.step() loop works too.
            loss = ctl.guarded_step(compute_loss, (x.to(device), y.to(device)))
            done += 1
            step = first_step + done
            if step == 1 or step % args.log_every == 0:
                print(stats_line(ctl, loss, len(x)), flush=True)
            if step == change_at and _budget(args.new_budget) is not None:
                # Any thread may call set_budget (the HTTP API's PUT does the same); the new
                # budget applies at the next step boundary and re-solves the allocation.
                change = ctl.set_budget(_budget(args.new_budget))
                print(f"budget change queued: {format_bytes(change['target_bytes'])} applies at step "
                      f"{change['applies_at_step']}", flush=True)
            if done >= steps:
                break
    return loss


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    dataset = make_dataset(args.samples, args.image_size, args.seed)
    model, optimizer, ctl = build(args, device)
    first_step = 0
    if args.resume:
        first_step = load_checkpoint(Path(args.resume), model, optimizer, ctl, device)
        print(f"resumed from {args.resume} at step {first_step}", flush=True)
    print(f"memctl {memctl.__version__}: SmallCNN on {device}, {args.steps} steps, budget "
          f"{_budget_text(ctl.stats())}", flush=True)
    if not args.no_serve:
        try:
            handle = ctl.serve(host=args.host, port=args.port)
        except memctl.MemctlError as exc:  # no token for a public address, port in use, ...
            print(f"error: {exc}", file=sys.stderr)
            ctl.detach()
            return 2
        print(f"memctl API at {handle.url}  (curl {handle.url}/v1/stats; "
              f"memctl budget 6MiB --url {handle.url})", flush=True)

    t0 = time.perf_counter()
    loss = train(ctl, model, dataset, device, args, args.steps, first_step)
    elapsed = time.perf_counter() - t0
    final = ctl.stats()
    print(f"trained {args.steps} steps in {elapsed:.1f} s: loss {loss:.3f}, ratio {final['ratio']:.1f}x, "
          f"{final['avg_bits']:.2f} bits/value, batch size {ctl.batch_size}, fallbacks {final['fallbacks']}",
          flush=True)

    with tempfile.TemporaryDirectory(prefix="memctl-example-") as tmp:
        path = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "checkpoint.pt"
        save_checkpoint(path, model, optimizer, ctl, first_step + args.steps)
        ctl.detach()  # hooks, monitor and server gone: `model` is plain PyTorch again
        print(f"saved checkpoint {path}; controller detached (attached: {ctl.attached})", flush=True)

        # A restarted job: fresh objects, then everything restored from the checkpoint.
        model2, optimizer2, ctl2 = build(args, device)
        step = load_checkpoint(path, model2, optimizer2, ctl2, device)
        print(f"restored checkpoint: controller at step {ctl2.step_count}, budget "
              f"{_budget_text(ctl2.stats())}, batch size {ctl2.batch_size}", flush=True)
        if args.resume_steps > 0:
            loss = train(ctl2, model2, dataset, device, args, args.resume_steps, step)
            print(f"after resuming: step {ctl2.step_count}, loss {loss:.3f}", flush=True)
        ctl2.detach()
    return 0


if __name__ == "__main__":
    sys.exit(main())
