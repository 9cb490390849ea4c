"""Whole-model weight-gradient cosine against plain PyTorch, per piecewise activation.

Run ``python benchmarks/activations.py [--acts relu,hardswish,...] [--seeds 5] [--bits 8,4,2]
[--mode derived|no-chain|image|separate|exact-act]``.

The net is two conv -> BatchNorm -> activation blocks, a global mean and a linear head
(16 images 3x16x16, 10 classes), the layout of ``tests/controller/test_regions.py``. For
each activation, bit width and seed it computes the weight gradient of one batch with
``Controller(model, opt, bits=b, bit_choices=(b,))`` (every layer at ``b`` bits) and
plain, and prints the mean and the lowest cosine over the seeds, and the activation
ratio memctl reports. The measured step follows ``--warm`` steps (default 1) at learning
rate 0 on the same batch: memctl's records from the second forward on are those of a
training run (its first forward still chains a value-dependent activation's input, NOTE [
No chain into a value-dependent derivative ] in memctl/controller/normalized.py). Modes:

    derived    as shipped (NOTE [ Outputs recomputed from the input ] in memctl/controller/derived.py,
               NOTE [ Batch-norm outputs recomputed from the input ] in normalized.py,
               NOTE [ Model inputs ] in inputs.py)
    no-chain   as shipped, but batch-norm outputs keep their own records
    image      as shipped, with keep_inputs=False: the image compressed at b bits (the default
               before NOTE [ Model inputs ]; every other mode keeps it by reference)
    separate   the batch norm's input, the activation's input and its output as separate records
               (the path before both)
    exact-act  the activation's input and output kept exact, everything else at b bits
               (batch-norm outputs keep their own records): what is left of the error is the
               other layers' tensors'

With ``--train-steps N`` it also trains a MobileNet-style net (ReLU6 stem, two inverted
residual blocks with hardswish) N AdamW steps plain and at 2 bits, and prints the share
of plain's loss drop reached and the ratio.

Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import platform
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import memctl
from memctl.controller import derived, packing

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU, "relu6": nn.ReLU6, "leaky_relu": lambda: nn.LeakyReLU(0.1), "hardtanh": nn.Hardtanh,
    "threshold": lambda: nn.Threshold(0.1, 0.0), "hardswish": nn.Hardswish, "hardsigmoid": nn.Hardsigmoid,
    "prelu": nn.PReLU, "elu": nn.ELU, "selu": nn.SELU, "celu": nn.CELU,
    "hardshrink": lambda: nn.Hardshrink(0.3), "softshrink": lambda: nn.Softshrink(0.3),
}


OPTIONS: dict[str, Any] = {}
"""Extra Controller options of the mode (``--mode image``)."""


class ConvNet(nn.Module):
    def __init__(self, act: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.c1, self.b1, self.a1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), act()
        self.c2, self.b2, self.a2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), act()
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a1(self.b1(self.c1(x)))
        x = self.a2(self.b2(self.c2(x)))
        return self.head(x.mean((2, 3)))


WARM = 1
"""Steps run with memctl attached before the measured one (``--warm``)."""


def weight_grad(name: str, bits: int | None, seed: int) -> tuple[torch.Tensor, float]:
    torch.manual_seed(seed)
    model = ConvNet(ACTIVATIONS[name])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(seed + 100)
    x, y = torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)
    ctl = None
    if bits is not None:
        ctl = memctl.Controller(model, opt, bits=float(bits), bit_choices=(bits,), monitor_interval_s=0,
                                **OPTIONS)
        for _ in range(WARM):  # lr 0: the weights stay; the records the later forwards make
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    ratio = float("nan")
    if ctl is not None:
        opt.step()
        ratio = float(ctl.stats()["ratio"])
        ctl.detach()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), ratio


class InvertedResidual(nn.Module):
    """MobileNetV3's block: 1x1 expand, BatchNorm, hardswish, 3x3 depthwise, BatchNorm, hardswish, 1x1."""

    def __init__(self, c: int, e: int) -> None:
        super().__init__()
        self.pw1, self.b1, self.a1 = nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.Hardswish()
        self.dw = nn.Conv2d(e, e, 3, padding=1, groups=e, bias=False)
        self.b2, self.a2 = nn.BatchNorm2d(e), nn.Hardswish()
        self.pw2, self.b3 = nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b3(self.pw2(self.a2(self.b2(self.dw(self.a1(self.b1(self.pw1(x))))))))


class MobileNetStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.act = nn.ReLU6()
        self.blocks = nn.Sequential(InvertedResidual(16, 64), InvertedResidual(16, 64))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.act(self.bn(self.stem(x)))).mean((2, 3)))


def train(steps: int, bits: int | None) -> tuple[float, float, float]:
    """First loss, mean of the last 3 losses and the ratio: AdamW 2e-3 on 32 images 3x32x32."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, 32, 32, generator=g)
    y = (x.flatten(1) @ torch.randn(3 * 32 * 32, 10, generator=g)).argmax(1)  # a function of the image
    torch.manual_seed(0)
    model = MobileNetStyle()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ctl = None
    if bits is not None:
        ctl = memctl.Controller(model, opt, bits=float(bits), bit_choices=(bits,), monitor_interval_s=0,
                                **OPTIONS)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    ratio = float("nan")
    if ctl is not None:
        ratio = float(ctl.stats()["ratio"])
        ctl.detach()
    return losses[0], sum(losses[-3:]) / 3, ratio


def _set_mode(mode: str) -> None:
    if mode == "derived":
        return
    if mode == "image":
        OPTIONS["keep_inputs"] = False
        return
    packing.chain_of = lambda t: None  # type: ignore[assignment]
    if mode == "no-chain":
        return
    derived.DerivableOutputs.take = lambda self, t: None  # type: ignore[method-assign]
    derived.DerivableOutputs.leftover = lambda self: []  # type: ignore[method-assign]
    if mode == "separate":
        return
    # exact-act: the activation's input (matched) and output (its grad_fn) kept as copies
    attach = packing.Packer._attach_region
    acts = {"HardswishBackward0", "EluBackward0", "CeluBackward0", "HardtanhBackward0", "LeakyReluBackward0",
            "ReluBackward0", "ThresholdBackward0", "HardsigmoidBackward0", "PreluKernelBackward0",
            "HardshrinkBackward0", "SoftshrinkBackward0"}

    def exact_input(self: Any, saved: Any, part: Any, source: torch.Tensor, layer: str) -> None:
        attach(self, saved, part, source, layer)
        saved.data, saved.regions = source.detach().clone(), ()

    compress = packing.Packer._compress

    def exact_output(self: Any, t: torch.Tensor, bits: float, eb: Any, seed: int, part: Any,
                     *rest: Any) -> Any:
        p, region = compress(self, t, bits, eb, seed, part, *rest)
        if t.grad_fn is not None and type(t.grad_fn).__name__ in acts:
            self._exact_outputs.append(t)
        return p, region

    pack_new = packing.Packer._pack_new

    def pack(self: Any, t: torch.Tensor, layer: str, *rest: Any) -> Any:
        self._exact_outputs = []
        saved = pack_new(self, t, layer, *rest)
        if self._exact_outputs:
            saved.data, saved.regions = t.detach().clone(), ()
        return saved

    packing.Packer._attach_region = exact_input  # type: ignore[method-assign]
    packing.Packer._compress = exact_output  # type: ignore[method-assign]
    packing.Packer._pack_new = pack  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--acts", default=",".join(ACTIVATIONS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--bits", default="8,4,2")
    parser.add_argument("--mode", choices=("derived", "no-chain", "image", "separate", "exact-act"),
                        default="derived")
    parser.add_argument("--warm", type=int, default=1,
                        help="steps with memctl before the measured one (0: its first forward, which chains "
                             "every batch-norm output: NOTE [ No chain into a value-dependent derivative ])")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="also train a MobileNet-style net this many steps, plain and at 2 bits")
    args = parser.parse_args()
    global WARM
    WARM = args.warm
    _set_mode(args.mode)
    torch.set_num_threads(1)
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, torch "
          f"{torch.__version__}, mode {args.mode}, {args.seeds} seeds; cosine mean (lowest), ratio")
    bits = [int(b) for b in args.bits.split(",")]
    print("| activation | " + " | ".join(f"{b} bits" for b in bits) + " |")
    print("|---|" + "---|" * len(bits))
    for name in args.acts.split(","):
        cells = []
        for b in bits:
            cos, ratios = [], []
            for seed in range(args.seeds):
                ref, _ = weight_grad(name, None, seed)
                got, ratio = weight_grad(name, b, seed)
                cos.append(float(F.cosine_similarity(got, ref, dim=0)))
                ratios.append(ratio)
            cells.append(f"{sum(cos) / len(cos):.5f} ({min(cos):.5f}) {sum(ratios) / len(ratios):.1f}x")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    if args.train_steps:
        first, plain, _ = train(args.train_steps, None)
        _, two, ratio = train(args.train_steps, 2)
        print(f"# MobileNet-style, {args.train_steps} steps: loss {first:.4f} -> plain {plain:.4f}, 2 bits "
              f"{two:.4f} ({(first - two) / (first - plain):.1%} of plain's drop) at {ratio:.1f}x")


if __name__ == "__main__":
    main()
