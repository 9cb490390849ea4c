"""Two CPU ranks over Gloo: DDP and FSDP2 training with a controller on each rank.

One spawn of two processes runs every scenario in turn (keeping the test's cost to one
start of two interpreters); each rank writes what it saw to a JSON file, and the tests
below read those files. The rank processes use the codecs' PyTorch reference
implementation (``codec_impl="reference"``), so no Numba kernel is compiled in them.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

WORLD = 2
STEPS = 6
BUDGET_STEP = 2  # rank 1 receives a budget PUT during this step
LAUNCH_TIMEOUT_S = 240.0
BUDGET = 52 * 2**10  # tight enough that the allocation compresses (static memory is ~28 KiB)
NEW_BUDGET = 49 * 2**10
OOM_STEP = 4  # rank 1 alone caps its batch size during this step


# -- the rank processes ----------------------------------------------------------------------
def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )


class _Checkpointed(torch.nn.Module):
    """A model whose middle block runs under ``torch.utils.checkpoint``."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.head = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU())
        self.block = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        self.tail = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(64, 4))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.head(x)
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.tail(h)


def _data(rank: int, step: int, batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank draws from its own distribution (rank 1's inputs are 20x wider and shifted)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    scale, shift = (1.0, 0.0) if rank == 0 else (20.0, 3.0)
    x = torch.randn(batch, 16, generator=g) * scale + shift
    return x, torch.randn(batch, 4, generator=g)


def _options(**extra: Any) -> dict[str, Any]:
    return {"monitor_interval_s": 0, "min_numel": 256, "group_size": 64, "codec_impl": "reference",
            "allocation_interval": 2, **extra}


def _cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    x = torch.cat([t.reshape(-1).double() for t in a])
    y = torch.cat([t.reshape(-1).double() for t in b])
    return float(x @ y / (x.norm() * y.norm()))


def _put_budget(url: str, value: object) -> int:
    req = urllib.request.Request(f"{url}/v1/budget", data=json.dumps({"target": value}).encode(),
                                 method="PUT", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(resp.status)


def _ddp_run(rank: int, out: dict[str, Any], sync: bool = True, base_port: int = 0) -> None:
    from torch.nn.parallel import DistributedDataParallel

    import memctl

    torch.manual_seed(0)
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, budget=BUDGET, **_options(sync_ranks=sync))
    # Every rank serves, at base_port + LOCAL_RANK.
    server = ctl.serve(port=base_port, port_per_rank=True) if sync else None
    steps = []
    for step in range(STEPS):
        x, y = _data(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if server is not None and rank == 1 and step == BUDGET_STEP:
            out["put_status"] = _put_budget(server.url, NEW_BUDGET)
        if sync and rank == 1 and step == OOM_STEP:
            ctl.lower_batch_estimate(5)
        opt.step()
        opt.zero_grad()
        st = ctl.stats()
        steps.append({
            "step": st["step"], "budget": st["budget"], "batch_size": st["batch_size"],
            "agreed": st["agreed"], "bits": {la["name"]: la["next_bits"] for la in st["layers"]},
            "vmax": {la["name"]: la["max"] for la in st["layers"]},
            "sensitivity": {la["name"]: la["sensitivity"] for la in st["layers"]},
        })
    out["ddp" if sync else "ddp_unsynced"] = {
        "steps": steps, "rank": ctl.stats()["rank"], "world_size": ctl.stats()["world_size"],
        "params": [float(p.detach().double().sum()) for p in model.parameters()],
    }
    if server is not None:
        out["port"] = server.port
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
            out["metrics"] = resp.read().decode()
        server.close()
    ctl.detach()


def _fsdp_model(mesh_seed: int = 0) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(mesh_seed)
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _local_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = []
    for p in model.parameters():
        g = p.grad
        grads.append((g.to_local() if hasattr(g, "to_local") else g).detach().clone())
    return grads


def _fsdp_run(rank: int, out: dict[str, Any]) -> None:
    import memctl
    from memctl.controller.fsdp import storage_key

    plain = _fsdp_model()
    x, y = _data(rank, 0)
    torch.nn.functional.mse_loss(plain(x), y).backward()
    plain_grads = _local_grads(plain)

    model = _fsdp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, **_options(bits=8, bit_choices=(8,), allow_keep=False))
    compressed: list[int | None] = []
    inner = ctl._packer._pack_new

    def spy(t: torch.Tensor, layer: str) -> Any:
        compressed.append(storage_key(t))
        return inner(t, layer)

    ctl._packer._pack_new = spy  # type: ignore[method-assign]
    resharded = []
    for step in range(3):
        xs, ys = _data(rank, step)
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        # After forward, FSDP has freed the gathered parameters of the inner modules.
        resharded.append([all(t.untyped_storage().size() == 0 for fp in _fsdp_params(m)
                              for t in fp.all_gather_outputs)
                          for m in list(model)[::2]])
        loss.backward()
        if step == 0:
            out["fsdp_cosine"] = _cosine(_local_grads(model), plain_grads)
        opt.step()
        opt.zero_grad()
    fsdp_keys = ctl._packer.fsdp.keys
    st = ctl.stats()
    out["fsdp"] = {
        "compressed": len(compressed),
        "compressed_params": sum(1 for k in compressed if k in fsdp_keys),
        "fsdp_keys": len(fsdp_keys),
        "saved_as_is": st["saved_as_is"],
        "resharded": resharded,
        "bits": [la["bits"] for la in st["layers"] if la["bits"] is not None],
        "agreed": st["agreed"],
    }
    ctl.detach()


def _fsdp_params(module: torch.nn.Module) -> list[Any]:
    state = module._get_fsdp_state()  # type: ignore[operator]
    return [fp for group in state._fsdp_param_groups for fp in group.fsdp_params]


def _wrap(model: torch.nn.Module, fsdp: bool) -> torch.nn.Module:
    if not fsdp:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        fully_shard(child)
    return fully_shard(model)


def _checkpoint_run(rank: int, reentrant: bool, out: dict[str, Any], fsdp: bool = False) -> None:
    import memctl
    from memctl.controller.fsdp import storage_key

    key = f"ckpt_{'fsdp' if fsdp else 'ddp'}_{reentrant}"
    torch.manual_seed(0)
    ref = _wrap(_Checkpointed(reentrant), fsdp)
    x, y = _data(rank, 0)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    ref_grads = _local_grads(ref)

    torch.manual_seed(0)
    model = _wrap(_Checkpointed(reentrant), fsdp)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, **_options(bits=8, bit_choices=(8,), allow_keep=False))
    packer = ctl._packer
    compressed: list[int | None] = []
    inner = packer._pack_new

    def spy(t: torch.Tensor, layer: str) -> Any:
        compressed.append(storage_key(t))
        return inner(t, layer)

    packer._pack_new = spy  # type: ignore[method-assign]
    rows = []
    for step in range(3):
        xs, ys = _data(rank, step)
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        after_forward = (packer.packs, packer.passed)
        loss.backward()
        after_backward = (packer.packs, packer.passed)
        if step == 0:
            out[f"{key}_cosine"] = _cosine(_local_grads(model), ref_grads)
        opt.step()
        opt.zero_grad()
        rows.append({"forward": after_forward, "backward": after_backward,
                     "raw_bytes": ctl.stats()["raw_bytes"]})
    out[key] = rows
    out[f"{key}_compressed_params"] = sum(1 for k in compressed if k in packer.fsdp.keys)
    if not fsdp:
        out[f"{key}_params"] = [float(p.detach().double().sum()) for p in model.parameters()]
    ctl.detach()


def _worker(rank: int, world: int, port: int, api_port: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    try:
        _ddp_run(rank, out, base_port=api_port)
        _ddp_run(rank, out, sync=False)
        _fsdp_run(rank, out)
        for fsdp in (False, True):
            for reentrant in (False, True):
                _checkpoint_run(rank, reentrant, out, fsdp=fsdp)
    except Exception:
        out["error"] = traceback.format_exc()
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()
        # Leave without C++ static destructors: once in a while a native thread still
        # joinable at interpreter exit aborts the rank ("terminate called without an active
        # exception") after everything above finished and the results are written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# -- the launch ------------------------------------------------------------------------------
def _free_port(consecutive: int = 1) -> int:
    """A port such that it and the next ``consecutive - 1`` ones are free (at this moment)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + consecutive > 65535:
            continue
        try:
            for k in range(1, consecutive):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", port + k))
        except OSError:
            continue
        return port
    raise RuntimeError("no free run of ports found")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    outdir = tmp_path_factory.mktemp("ranks")
    args = (WORLD, _free_port(), _free_port(WORLD), str(outdir))
    ctx = mp.start_processes(_worker, args=args, nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the {WORLD} rank processes did not finish within {LAUNCH_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    errors = [f"rank {r} failed:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    assert not errors, "\n".join(errors)
    return results


# -- DDP: agreement -------------------------------------------------------------------------
def test_ranks_and_world_size_are_reported(ranks: list[dict[str, Any]]) -> None:
    assert [r["ddp"]["rank"] for r in ranks] == [0, 1]
    assert all(r["ddp"]["world_size"] == WORLD for r in ranks)


def test_ddp_parameters_stay_in_sync(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["ddp"]["params"] == ranks[1]["ddp"]["params"]
    for reentrant in (False, True):
        assert ranks[0][f"ckpt_ddp_{reentrant}_params"] == ranks[1][f"ckpt_ddp_{reentrant}_params"]


def test_local_statistics_differ_but_allocation_and_batch_agree(ranks: list[dict[str, Any]]) -> None:
    s0, s1 = ranks[0]["ddp"]["steps"], ranks[1]["ddp"]["steps"]
    # The ranks' data differ, so do the value ranges each one saw ...
    assert s0[-1]["vmax"]["module.0"] * 5 < s1[-1]["vmax"]["module.0"]
    # ... yet every step they apply the same bits (a real trade-off, not all kept) and batch size.
    for a, b in zip(s0, s1, strict=True):
        assert a["bits"] == b["bits"]
        assert a["batch_size"] == b["batch_size"] is not None
        assert a["agreed"] and b["agreed"]
        assert min(a["bits"].values()) < 32
    assert any(len(set(a["bits"].values())) > 1 for a in s0)


def test_statistics_are_reduced_at_allocation_steps(ranks: list[dict[str, Any]]) -> None:
    # allocation_interval=2: the boundaries of steps 0, 2, 4 re-solve from reduced statistics.
    synced = [r["ddp"]["steps"] for r in ranks]
    unsynced = [r["ddp_unsynced"]["steps"] for r in ranks]
    for step in (0, 2, 4):
        assert synced[0][step]["sensitivity"] == synced[1][step]["sensitivity"]
        assert unsynced[0][step]["sensitivity"] != unsynced[1][step]["sensitivity"]
    assert not unsynced[0][0]["agreed"]


def test_a_rank_that_must_go_lower_takes_every_rank_lower(ranks: list[dict[str, Any]]) -> None:
    s0, s1 = ranks[0]["ddp"]["steps"], ranks[1]["ddp"]["steps"]
    assert s0[OOM_STEP - 1]["batch_size"] > 5
    assert s0[OOM_STEP]["batch_size"] == s1[OOM_STEP]["batch_size"] == 5


def test_budget_put_on_rank1_applies_on_both_ranks_at_the_same_step(ranks: list[dict[str, Any]]) -> None:
    assert ranks[1]["put_status"] == 200

    def first_step_with_new_budget(steps: list[dict[str, Any]]) -> int:
        return next(s["step"] for s in steps if s["budget"] == NEW_BUDGET)

    s0, s1 = ranks[0]["ddp"]["steps"], ranks[1]["ddp"]["steps"]
    assert first_step_with_new_budget(s0) == first_step_with_new_budget(s1)
    assert first_step_with_new_budget(s0) > BUDGET_STEP
    assert [s["budget"] for s in s0] == [s["budget"] for s in s1]


def test_each_rank_serves_on_its_port_with_rank_labels(ranks: list[dict[str, Any]]) -> None:
    assert ranks[1]["port"] == ranks[0]["port"] + 1
    for rank, r in enumerate(ranks):
        assert f'memctl_steps_total{{rank="{rank}"}}' in r["metrics"]
        assert f'memctl_world_size{{rank="{rank}"}} 2.0' in r["metrics"]
        assert f'rank="{1 - rank}"' not in r["metrics"]


# -- FSDP2 ---------------------------------------------------------------------------------
def test_fsdp_parameters_are_never_compressed(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        f = r["fsdp"]
        assert f["fsdp_keys"] > 0
        assert f["compressed"] > 0
        assert f["compressed_params"] == 0
        # The two inner Linears whose input needs a gradient save their weight: 3 steps x 2.
        assert f["saved_as_is"]["fsdp_parameters"] >= 6
        assert f["bits"] and all(b == 8 for b in f["bits"])


def test_fsdp_frees_gathered_parameters_after_forward(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert all(all(step) for step in r["fsdp"]["resharded"])


def test_fsdp_8bit_gradients_match_plain_fsdp(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["fsdp_cosine"] >= 0.9999


# -- activation checkpointing ------------------------------------------------------------------
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_regions_are_counted_once(ranks: list[dict[str, Any]], wrapper: str,
                                             reentrant: bool) -> None:
    key = f"ckpt_{wrapper}_{reentrant}"
    for r in ranks:
        rows = r[key]
        packs_per_step = [row["forward"][0] for row in rows]
        for row in rows:
            # Backward (with its recomputation) compresses nothing more ...
            assert row["backward"][0] == row["forward"][0]
        passed = [row["backward"][1] - row["forward"][1] for row in rows]
        if reentrant:
            # ... and the reentrant recomputation's saves are passed through.
            assert all(p > 0 for p in passed)
        assert packs_per_step == [packs_per_step[0] * (i + 1) for i in range(len(rows))]
        assert len({row["raw_bytes"] for row in rows}) == 1
        assert r[f"{key}_cosine"] >= 0.999
        assert not math.isnan(r[f"{key}_cosine"])
        assert r[f"{key}_compressed_params"] == 0


# -- without a process group (no processes started) -------------------------------------------
def test_without_a_process_group_a_controller_is_rank_0_of_1() -> None:
    import memctl

    model = _model()
    ctl = memctl.Controller(model, monitor_interval_s=0, codec_impl="reference")
    st = ctl.stats()
    assert (st["rank"], st["world_size"], st["agreed"]) == (0, 1, True)
    assert ctl.request_budget("1GiB")["applies_at_step"] == 1
    ctl.detach()


def test_process_group_and_codec_impl_are_checked() -> None:
    import memctl

    with pytest.raises(memctl.ConfigError, match="process_group"):
        memctl.Controller(_model(), monitor_interval_s=0, process_group="world")
    with pytest.raises(memctl.ConfigError, match="codec_impl"):
        memctl.Controller(_model(), monitor_interval_s=0, codec_impl="numba")


def test_reference_codec_impl_is_the_one_the_controller_runs() -> None:
    import memctl

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, **_options(bits=8, bit_choices=(8,)))
    x, y = _data(0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert ctl.stats()["ratio"] > 2.0
    assert ctl._packer._codecs["quantize"]._impl == "reference"  # type: ignore[union-attr]
    ctl.detach()
