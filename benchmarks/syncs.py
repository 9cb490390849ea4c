"""Waits for the GPU in a training step: synchronising calls by memctl call site, and the step time.

Each (model, policy) runs in its own process: a model of ``training.py`` (its batch times
``--scale``) is trained ``--warmup`` steps on the GPU with memctl attached (``plain``: without),
then one step runs under ``torch.cuda.set_sync_debug_mode("warn")``, and every warning PyTorch
gives for a synchronising call is counted at its innermost memctl frame (else at the innermost
frame outside this script). The forward's waits are counted apart from the rest of the step's:
a wait in the forward keeps the CPU from running ahead of the GPU while it queues the forward
(NOTE [ Exception lists without a wait ] in ``memctl/codecs/quantize/_pending.py``). Then the
median of ``--steps`` steps, each between two ``torch.cuda.synchronize()``.

PyTorch warns for the calls it knows to synchronise (``.item()``, ``nonzero``, copies to the
host, ...); a Numba launch, an event's wait and anything outside PyTorch go uncounted.
``--max-forward-waits N`` exits with status 1 when memctl's own frames wait more than ``N``
times in a forward (the model's and PyTorch's waits are listed, not held against it). Without
a GPU (``--device cpu``) the steps run and nothing is counted.

``--ops`` also counts the aten ops one more step dispatches (a ``TorchDispatchMode``; views
apart, as they launch nothing), each at its innermost memctl frame (``file:function``), and
those outside memctl: on a GPU each op that is not a view is a kernel launch of ~10 µs of
CPU, which is where a step bound by the CPU goes (the CPU's count is the CPU path's).

    python benchmarks/syncs.py --models cnn,transformer --policies plain,bits2,default
    python benchmarks/syncs.py --models resnet18,gpt2 --policies default --max-forward-waits 0
    python benchmarks/syncs.py --models cnn --policies bits2 --ops
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
POLICIES = ("plain", "bits2", "default")


def _memctl_frame(stack: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of memctl's own code (not this script's), or None."""
    for frame in reversed(stack):
        if "/memctl/" in frame.filename and "/benchmarks/" not in frame.filename:
            return frame
    return None


def _site(stack: list[traceback.FrameSummary]) -> str:
    frame = _memctl_frame(stack)
    if frame is not None:
        return f"memctl/{frame.filename.split('/memctl/')[-1]}:{frame.lineno} {frame.name}"
    for frame in reversed(stack):
        if not frame.filename.endswith(("syncs.py", "warnings.py")):
            return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    return "?"


_VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "as_strided", "slice", "select", "detach", "alias", "expand",
    "permute", "t", "transpose", "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "view_as",
    "unflatten", "flatten", "narrow", "chunk", "_reshape_alias", "lift_fresh",
})
"""Ops that make a view (no kernel): not counted by ``--ops``."""


def _op_site(stack: list[traceback.FrameSummary]) -> str:
    frame = _memctl_frame(stack)
    return "outside" if frame is None else f"memctl/{frame.filename.split('/memctl/')[-1]}:{frame.name}"


def count_ops(step: Any) -> collections.Counter[str]:
    """The aten ops (views apart) that ``step()`` dispatches, by innermost memctl frame."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter[str] = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.overloadpacket.__name__ not in _VIEWS:
                counts[_op_site(traceback.extract_stack()[:-1])] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return counts


def run_child(model_name: str, policy: str, device: str, scale: int, warmup: int,
              steps: int, ops: bool = False) -> dict[str, Any]:
    sys.path.insert(0, HERE)
    import training

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model, batch = training.build(model_name, scale)
    model.to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctl = None
    if policy != "plain":
        import memctl

        ctl = memctl.Controller(model, opt, bits=2 if policy == "bits2" else None, monitor_interval_s=0)
    gen = torch.Generator().manual_seed(1)
    data = [tuple(t.to(dev) for t in batch(gen)) for _ in range(2)]
    loss_fn = torch.nn.CrossEntropyLoss()

    def forward(i: int) -> torch.Tensor:
        x, y = data[i % len(data)]
        return loss_fn(model(x), y)  # type: ignore[no-any-return]

    def rest(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(warmup):
        rest(forward(i))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    counts: dict[str, collections.Counter[str]] = {"forward": collections.Counter(),
                                                    "rest": collections.Counter()}
    phase = ["forward"]

    def seen(message: Any, *args: Any, **kwargs: Any) -> None:
        if "synchroniz" in str(message):
            counts[phase[0]][_site(traceback.extract_stack()[:-1])] += 1

    if cuda:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen  # type: ignore[assignment]
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = forward(0)
                phase[0] = "rest"
                rest(loss)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    else:
        rest(forward(0))
    times = []
    for i in range(steps):
        sync()
        start = time.perf_counter()
        rest(forward(i))
        sync()
        times.append(time.perf_counter() - start)
    result = {"model": model_name, "policy": policy, "counted": cuda,
              "forward": dict(counts["forward"]), "rest": dict(counts["rest"]),
              "step_ms": statistics.median(times) * 1e3}
    if ops:
        result["ops"] = dict(count_ops(lambda: rest(forward(0))))
        sync()
    if ctl is not None:
        s = ctl.stats()
        result["ratio"] = s["raw_bytes"] / max(s["packed_bytes"], 1)
        ctl.detach()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,transformer", help="from training.py, comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"from {', '.join(POLICIES)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scale", type=int, default=8, help="batch size times this (training.py's --scale)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max-forward-waits", type=int, default=None)
    parser.add_argument("--ops", action="store_true", help="count one step's aten ops by memctl call site")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "POLICY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(*args.child, args.device, args.scale, args.warmup, args.steps, args.ops)))
        return
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    gpu = f", {torch.cuda.get_device_name(0)}" if args.device.startswith("cuda") else ""
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, device {args.device}{gpu}, torch "
          f"{torch.__version__}, batch x{args.scale}, {args.warmup} warm-up steps, median of {args.steps}")
    failed = False
    for model in [m for m in args.models.split(",") if m]:
        for policy in policies:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", model, policy,
                   "--device", args.device, "--scale", str(args.scale), "--warmup", str(args.warmup),
                   "--steps", str(args.steps), *(["--ops"] if args.ops else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{model:<12} {policy:<8} failed:\n{proc.stderr[-2000:]}")
                failed = True
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            forward, rest = sum(r["forward"].values()), sum(r["rest"].values())
            own = sum(n for site, n in r["forward"].items() if site.startswith("memctl/"))
            waits = f"{forward:>4} + {rest:<4}" if r["counted"] else "not counted"
            ratio = f"{r['ratio']:.1f}x" if "ratio" in r else "-"
            print(f"{model:<12} {policy:<8} waits (forward + rest) {waits}  step {r['step_ms']:8.2f} ms  "
                  f"ratio {ratio}")
            for phase in ("forward", "rest"):
                for site, n in sorted(r[phase].items(), key=lambda kv: -kv[1])[:8]:
                    print(f"    {phase:<7} {n:4d}  {site}")
            if "ops" in r:
                inside = {k: v for k, v in r["ops"].items() if k != "outside"}
                print(f"    aten ops in one step: {sum(inside.values())} inside memctl, "
                      f"{r['ops'].get('outside', 0)} outside")
                for site, n in sorted(inside.items(), key=lambda kv: -kv[1])[:12]:
                    print(f"    ops     {n:4d}  {site}")
            if (args.max_forward_waits is not None and policy != "plain" and r["counted"]
                    and own > args.max_forward_waits):
                print(f"    memctl waits {own} times in the forward, more than {args.max_forward_waits}")
                failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
