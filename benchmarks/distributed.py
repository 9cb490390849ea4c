"""Step time of 2-rank DDP and FSDP2 training, with and without memctl.

Run ``python benchmarks/distributed.py [--steps 30] [--rounds 2] [--world 2] [--device cpu]``.

Each configuration (``ddp``, ``ddp+memctl``, ``fsdp``, ``fsdp+memctl``) runs in its own group of
``--world`` processes (Gloo on the CPU, NCCL with ``--device cuda``, one GPU per rank), started
with ``torch.multiprocessing``. A rank trains an MLP (``--width`` wide, ``--depth`` hidden
layers, ReLU) on its own random batches; the first ``--warmup`` steps (Numba compilation,
FSDP's lazy initialisation) are not timed. memctl runs with its defaults (no budget: the
adaptive policy, calibrated and guarded) and its rank agreement on, so the figures include
the per-step all-reduce of NOTE [ Agreement across ranks ]. Rank 0 reports the median step
time and the peak resident memory of its process (``ru_maxrss``, read by the OS, not by
memctl; on the CPU the saved activations live there).

The configurations run one after another, in ``--rounds`` rounds whose order rotates, so
drift of a shared machine hits every configuration alike; compare within a round. Prints
figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIGS = ("ddp", "ddp+memctl", "fsdp", "fsdp+memctl")
# Not run by default: memctl without rank agreement (sync_ranks=False), to isolate its cost.
EXTRA_CONFIGS = ("ddp+memctl-local", "fsdp+memctl-local")


def _rank(rank: int, world: int, port: int, config: str, args: dict[str, Any], out: str) -> None:
    import resource

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    cuda = args["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.set_num_threads(args["threads"])
    if "+memctl" in config and not cuda:
        # The codecs' Numba kernels follow the same thread budget (two ranks on two cores
        # with two Numba threads each stall in every parallel region).
        import numba

        numba.set_num_threads(min(args["threads"], numba.config.NUMBA_NUM_THREADS))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(args["features"], args["width"]), torch.nn.ReLU()]
    for _ in range(args["depth"]):
        layers += [torch.nn.Linear(args["width"], args["width"]), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(args["width"], 10))
    model = torch.nn.Sequential(*layers).to(device)
    wrapped: torch.nn.Module
    if config.startswith("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))  # fully_shard's default is CUDA wherever it exists
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    ctl = None
    if "+memctl" in config:
        import memctl

        local = config.endswith("-local")
        ctl = memctl.Controller(wrapped, opt, monitor_interval_s=0, sync_ranks=not local)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args["warmup"] + args["steps"]):
        x = torch.randn(args["batch"], args["features"], generator=g).to(device)
        y = torch.randint(0, 10, (args["batch"],), generator=g).to(device)
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= args["warmup"]:
            times.append(time.perf_counter() - t0)
    result = {"median_ms": statistics.median(times) * 1e3, "mean_ms": statistics.fmean(times) * 1e3,
              "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if ctl is not None:
        st = ctl.stats()
        result.update(ratio=st["ratio"], avg_bits=st["avg_bits"], agreed=st["agreed"])
        ranks = ctl._ranks  # the agreement's own all-reduces, over every step including warm-up
        if ranks is not None and ranks.collectives:
            steps = args["warmup"] + args["steps"]
            result.update(sync_ms_per_step=ranks.collective_s * 1e3 / steps,
                          collectives_per_step=ranks.collectives / steps)
        ctl.detach()
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    del wrapped, opt
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(config: str, args: dict[str, Any], world: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.start_processes(_rank, args=(world, _free_port(), config, args, out), nprocs=world,
                           join=True, start_method="spawn")
        return dict(json.loads(Path(out).read_text()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch and Numba threads per rank (1)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, from {CONFIGS + EXTRA_CONFIGS}")
    ns = p.parse_args()
    configs = [c for c in ns.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS + EXTRA_CONFIGS))
    if unknown:
        p.error(f"--configs: unknown {unknown}; known: {CONFIGS + EXTRA_CONFIGS}")
    args = {k: getattr(ns, k) for k in ("steps", "warmup", "device", "batch", "features", "width", "depth",
                                         "threads")}
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"# {datetime.date.today()} {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}")
    print(f"# {ns.world} ranks on {ns.device}, MLP {ns.features}->{ns.depth}x{ns.width}->10, "
          f"batch {ns.batch} per rank, {ns.steps} timed steps after {ns.warmup}, "
          f"{ns.threads} torch thread(s) per rank")
    rows: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(ns.rounds):
        order = configs[r % len(configs):] + configs[: r % len(configs)]
        for config in order:
            res = _launch(config, args, ns.world)
            rows[config].append(res)
            extra = ""
            if "ratio" in res:
                extra = f"  ratio {res['ratio']:.1f}x  {res['avg_bits']:.2f} bits  agreed {res['agreed']}"
            if "sync_ms_per_step" in res:
                extra += (f"  agreement {res['sync_ms_per_step']:.2f} ms/step "
                          f"({res['collectives_per_step']:.2f} all-reduces/step)")
            print(f"round {r}  {config:<12} median {res['median_ms']:8.2f} ms  "
                  f"mean {res['mean_ms']:8.2f} ms  rank-0 peak RSS {res['max_rss_mib']:7.0f} MiB{extra}",
                  flush=True)
    print("\nconfig        median step (min over rounds)   vs plain")
    for config in configs:
        best = min(r["median_ms"] for r in rows[config])
        base_name = config.split("+")[0]
        base = min(r["median_ms"] for r in rows[base_name]) if rows.get(base_name) else None
        vs = f"{best / base:.2f}x" if base and config != base_name else ""
        print(f"{config:<13} {best:10.2f} ms                    {vs}")
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"# load at the end {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}")


if __name__ == "__main__":
    main()
