"""Is memctl's gradient unbiased? The mean of many compressed gradients at fixed weights against the exact.

Stochastic rounding makes each compressed gradient a random draw around the exact gradient.
If the draws are unbiased, the distance from their mean to the exact gradient falls as
``1/sqrt(N)`` over ``N`` draws; a bias stops it falling. This script trains ``memctl demo``'s
DigitsNet on the demo's data for ``--warmup`` plain steps, fixes the weights and one batch
of 128 images, takes the exact gradient, then ``--draws`` gradients with memctl attached
(each step draws the codec's rounding anew; the dropout mask and the batch-norm statistics
are the same in every pass), and prints:

- at N = 1, 4, 16, 64, 256, ...: one draw's mean relative error, the relative error of the
  mean of N draws, and what the latter would be for unbiased independent draws (the root
  mean square of one draw's error over ``sqrt(N)``: ``E‖mean − exact‖² = E‖e‖² / N``; the
  mean error instead, as before 2026-11-27, understates it where some draws are far worse
  than others);
- per parameter: the same at the last N, and their ratio (1 for unbiased draws, up to
  noise; a bias shows as a ratio that grows with N).

    python benchmarks/gradient_bias.py [--draws 256] [--bits 2] [--mode as-is|no-chain] [--act relu6]
    python benchmarks/gradient_bias.py --model gpt2 --warmup 10 --top 12   # a fidelity.py model

``--mode no-chain`` keeps batch-norm outputs in records of their own (no chains, NOTE [
Batch-norm outputs recomputed from the input ]). ``--act`` puts another activation in place
of every ReLU of the model (NOTE [ No chain into a value-dependent derivative ] in
memctl/controller/normalized.py has the figures). Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import ast
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memctl
from memctl.controller import packing
from memctl.demo import DigitsNet, _digits

ACTIVATIONS = {
    "relu": lambda: nn.ReLU(inplace=True),
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "relu6": lambda: nn.ReLU6(),
    "hardtanh": lambda: nn.Hardtanh(),
    "hardswish": lambda: nn.Hardswish(),
    "elu": lambda: nn.ELU(),
    "silu": lambda: nn.SiLU(),
    "gelu": lambda: nn.GELU(),
    "mish": lambda: nn.Mish(),
    "tanh": lambda: nn.Tanh(),
    "sigmoid": lambda: nn.Sigmoid(),
}


def _with_activation(model: nn.Module, name: str) -> nn.Module:
    """``model`` with every ``nn.ReLU`` replaced by a fresh ``ACTIVATIONS[name]``."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.ReLU):
                setattr(parent, child_name, ACTIVATIONS[name]())
    return model


def _option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` as a Controller keyword: VALUE read as a Python literal, else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--option {text!r}: expected KEY=VALUE, e.g. log_prob_bits=8")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _flat(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    per = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat([g.reshape(-1) for g in per.values()]), per


def _digits_model(act: str, seed: int, warmup: int) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """DigitsNet with ``act`` after ``warmup`` plain Adam steps, and the loss of one fixed batch."""
    xtr, ytr, _, _ = _digits(torch.device("cpu"))
    model = _with_activation(DigitsNet(), act)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for i in range(warmup):
        idx = torch.randint(0, len(xtr), (128,), generator=torch.Generator().manual_seed(100 + i))
        nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
        opt.zero_grad()
    idx = torch.randint(0, len(xtr), (128,), generator=torch.Generator().manual_seed(7 + seed))
    x, y = xtr[idx], ytr[idx]
    return model, lambda: nn.functional.cross_entropy(model(x), y)


def _fidelity_model(model_name: str, seed: int,
                    warmup: int) -> tuple[nn.Module, Callable[[], torch.Tensor], str]:
    """A model of ``benchmarks/fidelity.py`` (its library installed) after ``warmup`` plain AdamW
    steps on that script's batches, and the loss of its first batch."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fidelity

    spec = fidelity.SPECS.get(model_name)
    if spec is None:
        raise SystemExit(f"unknown --model {model_name!r}; choose from {', '.join(fidelity.SPECS)}")
    missing = fidelity._available(spec)
    if missing:
        raise SystemExit(missing)
    model = spec.build()
    batches = fidelity.make_batches(spec, max(warmup, 1), seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    for x, y in batches[:warmup]:
        fidelity.loss_of(spec, model, x, y).backward()
        opt.step()
        opt.zero_grad()
    x, y = batches[0]
    return model, lambda: fidelity.loss_of(spec, model, x, y), model_name


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=256)
    ap.add_argument("--bits", type=float, default=2.0)
    ap.add_argument("--warmup", type=int, default=60,
                    help="plain training steps before the weights are fixed")
    ap.add_argument("--mode", choices=("as-is", "no-chain"), default="as-is")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--act", choices=sorted(ACTIVATIONS), default="relu",
                    help="the model's activation (default: its own in-place ReLU)")
    ap.add_argument("--model", default="",
                    help="a model of benchmarks/fidelity.py (its extra installed) instead of DigitsNet")
    ap.add_argument("--top", type=int, default=0, help="print only the N parameters with the largest ratio")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a Controller keyword, e.g. log_prob_bits=8 or norm_bits=None (repeatable)")
    args = ap.parse_args(argv)
    options: dict[str, Any] = dict(_option(o) for o in args.option)
    if args.mode == "no-chain":
        packing.chain_of = lambda t: None

    torch.manual_seed(args.seed)
    if args.model:
        model, loss_of, name = _fidelity_model(args.model, args.seed, args.warmup)
    else:
        model, loss_of = _digits_model(args.act, args.seed, args.warmup)
        name = f"DigitsNet ({args.act})"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fixed = torch.optim.SGD(model.parameters(), lr=0.0)

    def gradient() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.load_state_dict(state)  # the batch norms' running statistics as they were
        torch.manual_seed(1234)  # the same dropout mask in every pass
        fixed.zero_grad(set_to_none=True)
        loss_of().backward()
        return _flat(model)

    exact, exact_per = gradient()
    ctl = memctl.Controller(model, fixed, bits=args.bits, calibration_fraction=0.0, monitor_interval_s=0,
                            **options)
    total = torch.zeros_like(exact)
    totals = {n: torch.zeros_like(g) for n, g in exact_per.items()}
    single = {n: 0.0 for n in exact_per}
    errors: list[float] = []
    print(f"{name}, {args.bits:g} bits, mode {args.mode}, options {options or {}}, {args.draws} draws "
          f"at fixed "
          f"weights (after {args.warmup} plain steps)")
    print(f"{'N':>6} {'one draw':>10} {'mean of N':>10} {'unbiased':>10}")
    checkpoints = {4**k for k in range(12)}
    for n in range(1, args.draws + 1):
        g, per = gradient()
        fixed.step()  # the controller's step boundary; lr 0 leaves the weights
        total += g
        errors.append(float((g - exact).norm() / exact.norm()))
        for name, v in per.items():
            totals[name] += v
            single[name] += float((v - exact_per[name]).norm() / exact_per[name].norm().clamp_min(1e-30)) ** 2
        if n in checkpoints or n == args.draws:
            one = sum(errors) / n
            rms = math.sqrt(sum(e * e for e in errors) / n)
            mean = float((total / n - exact).norm() / exact.norm())
            print(f"{n:>6} {one:>10.5f} {mean:>10.5f} {rms / math.sqrt(n):>10.5f}", flush=True)
    stats = ctl.stats()
    ctl.detach()
    print(f"average bits {stats['avg_bits']:.2f}, ratio {stats['ratio']:.1f}x")
    rows: list[tuple[str, float, float | None]] = []
    for pname, v in totals.items():
        norm = float(exact_per[pname].norm())
        if norm == 0.0:
            continue
        mean = float((v / args.draws - exact_per[pname]).norm()) / norm
        unbiased = math.sqrt(single[pname] / args.draws) / math.sqrt(args.draws)
        rows.append((pname, mean, unbiased if unbiased >= 1e-6 else None))  # None: read from no lossy record
    if args.top:
        rows = sorted((r for r in rows if r[2] is not None), key=lambda r: -r[1] / (r[2] or 1.0))[:args.top]
    width = max([20, *(len(r[0]) for r in rows)])
    print(f"{'parameter':<{width}} {'mean of N':>10} {'unbiased':>10} {'ratio':>7}")
    for pname, mean, unbiased in rows:
        if unbiased is None:
            print(f"{pname:<{width}} {mean:>10.5f} {'exact':>10} {'':>7}")
        else:
            print(f"{pname:<{width}} {mean:>10.5f} {unbiased:>10.5f} {mean / unbiased:>7.2f}")


if __name__ == "__main__":
    main()
