"""Convergence on real data over hundreds of steps: plain PyTorch against memctl, side by side.

Run ``python benchmarks/convergence.py [--tasks digits,text] [--steps 300] [--seeds 0,1,2]``.

Two real-data tasks, each trained ``--steps`` steps from the same seed on the same
batches, once per configuration and seed, each in its own process:

    digits  the demo's data and model: scikit-learn's handwritten digits loaded as
            ``memctl demo`` loads them (1,440 training and 357 test images, 16x16), the
            demo's ``DigitsNet``, Adam lr 2e-3, batch 128, the same steps as the demo at seed
            S (``plain`` is its baseline run, ``bits2`` its memctl run; the demo decays the
            rate as ``--schedule cosine`` does, or keeps it with ``--lr-schedule constant``).
            Validation: the 357 test images.
    text    a small causal transformer language model (3 layers, d 128, 4 heads,
            context 64, byte level, AdamW lr 1e-3, batch 16) on English text: the
            docstrings of the Python standard library's own source files, read with
            ``ast`` (nothing is imported), files in sorted order; every tenth file is
            validation. The text therefore depends on the Python version, printed in
            the header. Validation: 64 fixed windows of the validation text.
    text-lstm  the same text, batches and validation, learned by a byte-level LSTM (an
            embedding of 128, two LSTM layers of 256, a linear head; AdamW lr 2e-3): a
            recurrent model, whose layers memctl runs fused (NOTE [ Fused recurrent
            layers ]). Not in the default ``--tasks``.
    text-gru   the same with GRU layers. Not in the default ``--tasks``.
    text-explicit  the ``text`` model with its attention written out, as nanoGPT's path
            without flash attention writes it: ``softmax((q @ kᵀ) · d^-½`` with the causal
            mask filled in as ``-inf``) ``@ v``, whose probabilities memctl recomputes from the
            query and key (NOTE [ Attention probabilities recomputed from query and key ]).
            Not in the default ``--tasks``.

``--schedule cosine`` decays every configuration's learning rate to zero over the run
(``CosineAnnealingLR``, as ``memctl demo`` does by default) instead of keeping it constant. At a constant rate
the digits' final validation loss (~0.02-0.04: a few of the 357 test images, confidently
wrong, make most of it) follows the run's last steps: memctl's runs land -24% to +57% from
plain's of the same seed, and plain itself +8% to +21% from its own run under a tiny gradient
perturbation (the ``jitter`` rows), so a difference of 2% cannot be resolved; with the decay
the perturbed plain runs land within -3.5% to +3.2% of plain's.

A single plain run is one draw: at the decayed rate the digits' plain PyTorch, started from
weights changed by one part in a million (``plain1``, ``plain2``, ``plain3``: each weight
times ``1 + 1e-6·N(0, 1)``, nothing else), ends a few percent from its own run either way,
as a rerun on another BLAS or GPU would. With any of them in ``--configs``, the summary
also gives each configuration against the mean of plain's runs of its seed (plain's and the
perturbed ones'), as a mean over the seeds with its standard error: what "within 2% of
plain's" can be resolved to with the seeds run.

Configurations: ``plain`` (no memctl), ``default`` (``Controller(model, opt)``, the
adaptive policy), ``bits2`` and ``bits4`` (``bits=2`` / ``bits=4``). Per row: the final
validation loss and its difference from plain's (same seed), accuracy (digits) or bits per
byte (text), the activation ratio memctl reports, the same ratio measured outside memctl's
statistics (as in ``benchmarks/fidelity.py``: the storages a plain ``saved_tensors_hooks``
counter sees in the plain run against the real buffer sizes of the records memctl's pack
hook returned, at the last step, the parameters and the batch left out of both), the
average bits, guard events, and the wall time of the training loop. Prints figures, asserts
nothing; progress goes to stderr.

``--audit N`` (with a memctl configuration) ends each run with the audit of ``benchmarks/
variance_audit.py``: the variance model's prediction for the 12 largest layers (``--audit-layers``)
at every width
against fresh replays at the final weights, on ``N`` batches drawn as the training batches
are but with another generator, so the run never stepped on them in that order (the next
steps' kind of batch, where ``fidelity.py``'s audit has only the four it cycles over).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_HERE = Path(__file__).resolve().parent
CONFIGS = ("plain", "default", "bits2", "bits4")
JITTER = ("jitter0", "jitter1", "jitter2")
"""Plain training with isotropic Gaussian noise added to every step's gradient (``--jitter``,
its expected squared norm; the digit seeds the noise): how far a perturbation of the size
memctl adds moves the result on its own. Not in the default ``--configs``."""
PERTURBED = ("plain1", "plain2", "plain3")
"""Plain training from the initial weights perturbed by one part in a million (each weight
times ``1 + 1e-6·N(0, 1)``, the digit seeding the draw), nothing else changed: plain's own
spread (module docstring). Not in the default ``--configs``."""
PERTURBATION = 1e-6
TASKS = ("digits", "text", "text-lstm", "text-gru", "text-explicit")
DEFAULT_TASKS = ("digits", "text")
SCHEDULES = ("constant", "cosine")
TARGET = "target (issue 14): validation loss within 2% of plain's at the default policy and at bits=2"


def _progress(msg: str) -> None:
    print(f"[convergence] {msg}", file=sys.stderr, flush=True)


# -- text: the standard library's docstrings ----------------------------------------------------
def stdlib_docstrings() -> tuple[bytes, bytes]:
    """(train, validation) bytes: docstrings of the stdlib's source files, every tenth file to validation.

    Files are the ``*.py`` under ``sysconfig``'s stdlib path, test suites and
    site-packages left out, in sorted order; each file's module, class and function
    docstrings are joined by blank lines. Only ASCII is kept, so the byte vocabulary is
    at most 128.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    train: list[str] = []
    val: list[str] = []
    for i, path in enumerate(files):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs = [d for node in ast.walk(tree)
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and (d := ast.get_docstring(node))]
        (val if i % 10 == 9 else train).extend(docs)
    encode = lambda parts: "\n\n".join(parts).encode("ascii", "ignore")  # noqa: E731
    return encode(train), encode(val)


class CausalLM(nn.Module):
    """A pre-norm causal transformer over bytes (GELU MLP, learned positions)."""

    def __init__(self, vocab: int = 128, d: int = 128, layers: int = 4, heads: int = 4,
                 ctx: int = 128, explicit: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(_Block(d, heads, explicit) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class RecurrentLM(nn.Module):
    """A byte-level recurrent language model (embedding, stacked LSTM or GRU, linear head)."""

    def __init__(self, kind: type[nn.LSTM] | type[nn.GRU] = nn.LSTM, vocab: int = 128, d: int = 128,
                 hidden: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.rnn = kind(d, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.rnn(self.tok(idx))[0])
        return out


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, explicit: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.explicit = explicit
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.explicit:  # the same values, written out (the ``text-explicit`` task)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
            a = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(self.act(self.fc(self.ln2(x))))


# -- the tasks ----------------------------------------------------------------------------------
class Task:
    """Model, optimizer, batches and validation of one task (built the same in every process)."""

    def __init__(self, name: str, seed: int, steps: int, schedule: str = "constant") -> None:
        self.name = name
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed + 1)
        if name == "digits":
            from memctl.demo import DigitsNet, _digits, _saved_bytes_plain

            xtr, ytr, self.xval, self.yval = _digits(torch.device("cpu"))
            self.model: nn.Module = DigitsNet()
            self.opt: torch.optim.Optimizer = torch.optim.Adam(self.model.parameters(), lr=2e-3)
            # as the demo does before training (one forward and backward: dropout's random
            # numbers and BatchNorm's running statistics then match the demo's run)
            _saved_bytes_plain(self.model, xtr[:128], ytr[:128])
            idx = [torch.randint(0, len(xtr), (128,), generator=g) for _ in range(steps)]
            self.batches = [(xtr[i], ytr[i]) for i in idx]
            self._draw: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]] = (
                lambda gen: (lambda i: (xtr[i], ytr[i]))(torch.randint(0, len(xtr), (128,), generator=gen)))
        else:
            train, val = stdlib_docstrings()
            ctx, batch = 64, 16
            tr = torch.frombuffer(bytearray(train), dtype=torch.uint8).long()
            va = torch.frombuffer(bytearray(val), dtype=torch.uint8).long()
            if name in ("text-lstm", "text-gru"):
                self.model = RecurrentLM(nn.LSTM if name == "text-lstm" else nn.GRU)
                self.opt = torch.optim.AdamW(self.model.parameters(), lr=2e-3, weight_decay=0.01)
            else:
                self.model = CausalLM(layers=3, ctx=ctx, explicit=name == "text-explicit")
                self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)
            def window(st: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return (torch.stack([tr[s:s + ctx] for s in st.tolist()]),
                        torch.stack([tr[s + 1:s + ctx + 1] for s in st.tolist()]))

            starts = [torch.randint(0, len(tr) - ctx - 1, (batch,), generator=g) for _ in range(steps)]
            self.batches = [window(st) for st in starts]
            self._draw = lambda gen: window(torch.randint(0, len(tr) - ctx - 1, (batch,), generator=gen))
            vstarts = torch.linspace(0, len(va) - ctx - 2, 64).long().tolist()
            self.xval = torch.stack([va[s:s + ctx] for s in vstarts])
            self.yval = torch.stack([va[s + 1:s + ctx + 1] for s in vstarts])
            self.text_bytes = (len(train), len(val))
        # --schedule (module docstring): a cosine decay to zero over the run, or none
        self.scheduler = (torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=steps)
                          if schedule == "cosine" else None)

    def fresh_batches(self, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` batches drawn as the training batches are, from another generator (``--audit``)."""
        gen = torch.Generator().manual_seed(seed + 7777)
        return [self._draw(gen) for _ in range(n)]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def validate(self) -> dict[str, float]:
        self.model.eval()
        with torch.no_grad():
            out = self.model(self.xval)
            loss = float(F.cross_entropy(out.reshape(-1, out.shape[-1]), self.yval.reshape(-1)))
            acc = float((out.argmax(-1) == self.yval).float().mean()) * 100
        self.model.train()
        return {"val_loss": loss, "val_acc": acc}


# -- one configuration in one process ------------------------------------------------------------
def _fidelity() -> Any:
    if str(_HERE) not in sys.path:
        sys.path.insert(0, str(_HERE))
    import fidelity

    return fidelity


def run_worker(task_name: str, config: str, steps: int, seed: int, threads: int,
               observe_loss: bool, extra: dict[str, Any], schedule: str = "constant",
               audit_batches: int = 0, audit_layers: int = 12) -> dict[str, Any]:
    if threads > 0:
        torch.set_num_threads(threads)
    import memctl

    fid = _fidelity()
    task = Task(task_name, seed, steps, schedule)
    model = task.model
    model.train()
    counter = fid._PlainCounter(model)
    packed_seen: set[int] = set()
    packed_total = [0]
    # the last step's records, measured once its forward is over: a record can grow after
    # its pack returned (NOTE [ Bit floors ], NOTE [ Outputs recomputed from the input ])
    records: list[Any] = []
    collect = [False]
    ctl = None
    if config in PERTURBED:
        gen = torch.Generator().manual_seed(2000 + 100 * seed + int(config[-1]))
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + PERTURBATION * torch.randn(p.shape, generator=gen))
    jitter = torch.Generator().manual_seed(1000 + int(config[-1])) if config in JITTER else None
    jitter_sq = float(extra.pop("jitter", 5e-4))
    n_params = sum(p.numel() for p in model.parameters())
    if config not in ("plain", *PERTURBED) and jitter is None:
        options: dict[str, Any] = {"monitor_interval_s": 0}
        if config in ("bits2", "bits4"):
            options["bits"] = float(config[-1])
        options.update(extra)
        ctl = memctl.Controller(model, task.opt, **options)
        fid._collect_records(ctl, records, collect)
    losses: list[float] = []
    curve: list[tuple[int, float]] = []
    bits_curve: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    eval_s = 0.0
    for i, (x, y) in enumerate(task.batches):
        last = i == len(task.batches) - 1
        if last:
            packed_seen.clear()
            packed_total[0] = 0
            collect[0] = True
            counter.hold(x, y)
        if config in ("plain", *JITTER, *PERTURBED) and last:
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                loss = task.loss(x, y)
        else:
            loss = task.loss(x, y)
        if last and records:
            collect[0] = False
            packed_total[0] = sum(fid._record_bytes(r, counter.held, packed_seen) for r in records)
            records.clear()
        loss.backward()
        if jitter is not None:
            std = math.sqrt(jitter_sq / n_params)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.add_(torch.randn(p.shape, generator=jitter) * std)
        task.opt.step()
        task.opt.zero_grad(set_to_none=True)
        if task.scheduler is not None:
            task.scheduler.step()
        losses.append(float(loss.detach()))
        if ctl is not None and observe_loss:
            ctl.observe_loss(losses[-1])
        if ctl is not None and (i + 1) % 25 == 0:
            bits_curve.append((i + 1, round(float(ctl.stats()["avg_bits"]), 3)))
        if (i + 1) % max(1, steps // 4) == 0 and not last:
            e0 = time.perf_counter()
            curve.append((i + 1, task.validate()["val_loss"]))
            eval_s += time.perf_counter() - e0
            _progress(f"  {task_name}/{config}/seed {seed} step {i + 1}/{steps} "
                      f"train {losses[-1]:.4f} val {curve[-1][1]:.4f}")
    result: dict[str, Any] = {"task": task_name, "config": config, "seed": seed,
                              "time_s": time.perf_counter() - t0 - eval_s}
    result.update(task.validate())
    curve.append((steps, result["val_loss"]))
    result["curve"] = curve
    result["train_tail"] = sum(losses[-20:]) / len(losses[-20:])
    if task_name.startswith("text"):
        result["text_bytes"] = task.text_bytes
    if ctl is not None:
        s = ctl.stats()
        result["ratio"] = s["raw_bytes"] / max(s["packed_bytes"], 1)
        result["avg_bits"] = s.get("avg_bits")
        result["saved_bytes"] = packed_total[0]
        counts = s["counters"]["events"]
        result["guard_events"] = int(counts.get("guard", 0))
        result["fallbacks"] = int(s["fallbacks"])
        result["probes"] = s["calibration"]["probes"]
        result["bits"] = {layer["name"]: layer["bits"] for layer in s["layers"]}
        result["bits_curve"] = bits_curve
        result["calibration"] = s["calibration"]
        result["guard_messages"] = [f"step {e.get('step')}: {e.get('message')}" for e in s["events"]
                                    if e.get("kind") == "guard"]
        if audit_batches > 0:
            from variance_audit import audit

            fresh = task.fresh_batches(audit_batches, seed)
            result["audit"] = audit(ctl, [lambda x=x, y=y: task.loss(x, y) for x, y in fresh],
                                    layers=audit_layers)
        ctl.detach()
    else:
        result["saved_bytes"] = sum(counter.storages.values())
    return result


# -- the driver ---------------------------------------------------------------------------------
def _run_config(task: str, config: str, steps: int, seed: int, timeout: float, threads: int,
                observe_loss: bool, options: list[str], jitter: float, schedule: str,
                audit_batches: int = 0, audit_layers: int = 12) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", task, config, "--steps", str(steps),
           "--seeds", str(seed), "--threads", str(threads), "--schedule", schedule,
           "--audit", str(audit_batches), "--audit-layers", str(audit_layers)]
    cmd += ["--observe-loss"] if observe_loss else []
    cmd += [arg for option in options for arg in ("--option", option)]
    cmd += ["--jitter", str(jitter)]
    return dict(_fidelity().run_child(cmd, threads, timeout, {"task": task, "config": config, "seed": seed}))


HEADER = (f"{'task':7s} {'config':8s} {'seed':>4s} {'val_loss':>9s} {'vs_plain':>9s} {'acc%':>6s} "
          f"{'bpb':>6s} {'ratio':>7s} {'outside':>7s} {'bits':>5s} {'guard':>5s} {'time_s':>7s}")


def row(r: dict[str, Any], plain: dict[str, Any] | None) -> str:
    if "error" in r:
        return f"{r['task']:7s} {r['config']:8s} {r['seed']:4d} error: {r['error']}"
    base = plain if plain is not None and "error" not in plain else None
    rel = (r["val_loss"] / base["val_loss"] - 1) * 100 if base else math.nan
    outside = base["saved_bytes"] / r["saved_bytes"] if base and r.get("saved_bytes") else math.nan
    bpb = r["val_loss"] / math.log(2) if r["task"].startswith("text") else math.nan
    bits = r.get("avg_bits")
    return (f"{r['task']:7s} {r['config']:8s} {r['seed']:4d} {r['val_loss']:9.4f} {rel:+8.2f}% "
            f"{r['val_acc']:6.2f} {bpb:6.3f} {r.get('ratio', 1.0):6.1f}x {outside:6.1f}x "
            f"{bits if bits is not None else math.nan:5.2f} {r.get('guard_events', 0):5d} {r['time_s']:7.1f}")


def summary(task: str, results: dict[tuple[str, int], dict[str, Any]], seeds: list[int],
            configs: list[str]) -> list[str]:
    """Mean over seeds per configuration, with the spread of the per-seed differences."""
    lines = []
    for config in configs:
        rels, accs, vals = [], [], []
        for seed in seeds:
            r, p = results.get((config, seed)), results.get(("plain", seed))
            if r is None or p is None or "error" in r or "error" in p:
                continue
            vals.append(r["val_loss"])
            accs.append(r["val_acc"])
            rels.append((r["val_loss"] / p["val_loss"] - 1) * 100)
        if not vals:
            continue
        spread = f"[{min(rels):+.2f}, {max(rels):+.2f}]" if config != "plain" else ""
        lines.append(f"{task:7s} {config:8s} mean over {len(vals)} seed(s): "
                     f"val_loss {sum(vals) / len(vals):.4f} "
                     f"({sum(rels) / len(rels):+.2f}% vs plain, per seed {spread}) "
                     f"acc {sum(accs) / len(accs):.2f}%")
    if any(c in PERTURBED for c in configs):
        lines += _against_plains(task, results, seeds, configs)
    return lines


def _against_plains(task: str, results: dict[tuple[str, int], dict[str, Any]], seeds: list[int],
                    configs: list[str]) -> list[str]:
    """Each configuration against the mean validation loss of plain's runs of its seed (plain's and
    the ``PERTURBED`` ones'), as a mean over seeds with its standard error: a single plain run is
    one draw of a process that an immaterial change moves by a few percent (module docstring)."""
    lines = []
    for config in configs:
        rels = []
        for seed in seeds:
            plains = [results[(c, seed)]["val_loss"] for c in ("plain", *PERTURBED)
                      if (c, seed) in results and "error" not in results[(c, seed)]]
            r = results.get((config, seed))
            if len(plains) < 2 or r is None or "error" in r:
                continue
            rels.append((r["val_loss"] / (sum(plains) / len(plains)) - 1) * 100)
        if not rels:
            continue
        se = statistics.stdev(rels) / math.sqrt(len(rels)) if len(rels) > 1 else math.nan
        lines.append(f"{task:7s} {config:8s} vs the mean of plain's runs of each seed, over {len(rels)} "
                     f"seed(s): {statistics.fmean(rels):+.2f}% ± {se:.2f}% (standard error), "
                     f"per seed [{min(rels):+.2f}, {max(rels):+.2f}]")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0", help="comma-separated")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="plain is always run")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch/Numba threads per process (0: their defaults); 1 keeps a busy machine fair")
    ap.add_argument("--observe-loss", action="store_true",
                    help="also give each step's loss to Controller.observe_loss (the guard's loss trend)")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="an extra Controller keyword for the memctl runs (a Python literal), "
                         "e.g. guard_bound=0.1")
    ap.add_argument("--jitter", type=float, default=5e-4,
                    help="expected squared norm of the gradient noise of the jitterN configurations")
    ap.add_argument("--schedule", choices=SCHEDULES, default="constant",
                    help="learning rate over the run, the same in every configuration: constant (the "
                         "demo's --lr-schedule constant) or a cosine decay to zero (the demo's default)")
    ap.add_argument("--audit", type=int, default=0, metavar="N",
                    help="end each memctl run with the variance model's audit on N fresh batches")
    ap.add_argument("--audit-layers", type=int, default=12, metavar="K",
                    help="the audit's layers: the K largest (default 12)")
    ap.add_argument("--worker", nargs=2, metavar=("TASK", "CONFIG"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write every result to this file")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.worker:
        extra = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in args.option)}
        extra["jitter"] = args.jitter
        result = run_worker(args.worker[0], args.worker[1], args.steps, seeds[0], args.threads,
                            args.observe_loss, extra, args.schedule, args.audit, args.audit_layers)
        print("RESULT " + json.dumps(result))
        return 0
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        ap.error(f"unknown task(s) {unknown}; known: {list(TASKS)}")
    configs = ["plain"] + [c for c in args.configs.split(",") if c and c != "plain"]
    unknown = [c for c in configs if c not in CONFIGS + JITTER + PERTURBED]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; known: {list(CONFIGS + JITTER + PERTURBED)}")
    print(f"# memctl convergence benchmark, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, Python {platform.python_version()}, load {os.getloadavg()[0]:.1f}")
    print(f"# {args.steps} steps, {args.schedule} learning rate, seeds {seeds}, "
          f"{args.threads or 'default'} thread(s) per process"
          f"{', observe_loss' if args.observe_loss else ''}"
          f"{''.join(', ' + o for o in args.option)}; {TARGET}")
    print(HEADER, flush=True)
    everything: list[dict[str, Any]] = []
    for task in tasks:
        results: dict[tuple[str, int], dict[str, Any]] = {}
        for seed in seeds:
            for config in configs:
                _progress(f"{task}: {config}, seed {seed}")
                r = _run_config(task, config, args.steps, seed, args.timeout, args.threads, args.observe_loss,
                                args.option, args.jitter, args.schedule, args.audit, args.audit_layers)
                results[(config, seed)] = r
                everything.append(r)
                print(row(r, results.get(("plain", seed))), flush=True)
                if r.get("audit"):
                    from variance_audit import summarise_audit

                    for line in summarise_audit(f"{task}/{config}/seed {seed}", r["audit"], per_batch=False):
                        print(line, flush=True)
        for line in summary(task, results, seeds, configs):
            print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    print(f"# load at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
