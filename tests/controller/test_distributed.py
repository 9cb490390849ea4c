"""Two CPU ranks over Gloo: DDP and FSDP2 training with a controller on each rank.

Also: rank 0's aggregated view (``/v1/ranks``, ``/metrics?ranks=all``), the calibration
probes and the convergence guard agreed across ranks, and ``detach()`` / ``load_state_dict``
on one rank alone.

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
CAL_STEPS = 8
TURN_STEP = 6  # rank 1's loss turns back up from here; step 6 is an allocation step


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
    # the ranks' inputs differ in scale: the first layer's record (the input, compressed here)
    # shows each rank its own value range
    ctl = memctl.Controller(model, opt, budget=BUDGET, **_options(sync_ranks=sync, keep_inputs=False))
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
        with urllib.request.urlopen(f"{server.url}/metrics?ranks=all", timeout=10) as resp:
            out["metrics_all"] = resp.read().decode()
        with urllib.request.urlopen(f"{server.url}/v1/ranks", timeout=10) as resp:
            out["ranks_view"] = json.loads(resp.read().decode())
        out["rows_step"] = ctl.stats()["step"]
        server.close()
    ctl.detach()


_MESH: list[Any] = []


def _cpu_mesh() -> Any:
    """One CPU device mesh over every rank, made once per process. ``fully_shard``'s default
    mesh takes the CUDA device type wherever CUDA is available, and a CUDA mesh over this Gloo
    run hangs in its group's creation."""
    if not _MESH:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH.append(init_device_mesh("cpu", (dist.get_world_size(),)))
    return _MESH[0]


def _fsdp_model(mesh_seed: int = 0) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(mesh_seed)
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=_cpu_mesh())
    fully_shard(model, mesh=_cpu_mesh())
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

    def spy(t: torch.Tensor, layer: str, *rest: Any) -> Any:
        compressed.append(storage_key(t))
        return inner(t, layer, *rest)

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
        "probes": st["calibration"]["probes"],
        "kinds": [e["kind"] for e in st["events"]],
    }
    ctl.detach()


def _fsdp_params(module: torch.nn.Module) -> list[Any]:
    """The module's ``FSDPParam``s, read as memctl reads them (torch 2.11 keeps one
    ``_fsdp_param_group`` per state, later releases a list, ``_fsdp_param_groups``)."""
    from memctl.controller.fsdp import _state_params

    return list(_state_params(module._get_fsdp_state()))  # type: ignore[operator]


def _wrap(model: torch.nn.Module, fsdp: bool) -> torch.nn.Module:
    if not fsdp:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        fully_shard(child, mesh=_cpu_mesh())
    return fully_shard(model, mesh=_cpu_mesh())


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

    def spy(t: torch.Tensor, layer: str, *rest: Any) -> Any:
        compressed.append(storage_key(t))
        return inner(t, layer, *rest)

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


def _calibrated_run(rank: int, out: dict[str, Any], calibrate: bool = True) -> None:
    """The default policy (calibrated, guarded) under DDP; rank 1's loss alone turns back up.

    Without calibration only the guard's loss signal can raise bits."""
    from torch.nn.parallel import DistributedDataParallel

    import memctl

    torch.manual_seed(0)
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, **_options(calibration_fraction=1.0 if calibrate else 0.0,
                                                   bit_choices=(1, 2, 4, 8)))
    grads_before: list[torch.Tensor] = []
    touched: list[bool] = []
    opt.register_step_pre_hook(lambda o, a, k: grads_before.__setitem__(
        slice(None), [p.grad.clone() for p in model.parameters()]))
    # Registered after the controller's hook: sees .grad after the boundary's replays.
    opt.register_step_post_hook(lambda o, a, k: touched.append(any(
        not torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_before, strict=True))))
    losses = [10.0, 8.0, 6.0, 4.0, 3.0, 2.0, 9.0, 10.0]
    steps = []
    for step in range(CAL_STEPS):
        x, y = _data(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ctl.observe_loss(losses[step] if rank == 1 else 1.0)
        opt.step()
        opt.zero_grad()
        st = ctl.stats()
        steps.append({
            "bits": {la["name"]: la["next_bits"] for la in st["layers"]},
            "floors": {la["name"]: la["floor_bits"] for la in st["layers"]},
            "measured": {la["name"]: la.get("variance_measured", {}) for la in st["layers"]},
            "probes": st["calibration"]["probes"],
            "guard_actions": st["calibration"]["guard_actions"],
            "agreed": st["agreed"],
        })
    st = ctl.stats()
    out["calibrated" if calibrate else "loss_guard"] = {
        "steps": steps, "touched": touched,
        "events": [(e["step"], e["kind"]) for e in st["events"]],
        "params": [float(p.detach().double().sum()) for p in model.parameters()],
        "reference": st["calibration"]["grad_variance"],
        "collectives": ctl._ranks.collectives if ctl._ranks is not None else None,
    }
    ctl.detach()


def _leave_run(rank: int, out: dict[str, Any]) -> None:
    """Rank 1 detaches alone after step 1; later both ranks detach together. Training goes on."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    import memctl

    torch.manual_seed(0)
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, budget=BUDGET, **_options())
    rows = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            x, y = _data(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if rank == 1 and step == 1:
                ctl.detach()
            st = ctl.stats()
            rows.append({"step": st["step"], "agreed": st["agreed"], "attached": ctl.attached})
    st = ctl.stats()
    out["leave"] = {
        "rows": rows, "errors": st["errors"],
        "messages": [e["message"] for e in st["events"] if e["kind"] in ("error", "ranks")],
        "warnings": [str(w.message) for w in caught if "detach" in str(w.message)],
        "params": [float(p.detach().double().sum()) for p in model.parameters()],
    }
    ctl.detach()
    # Both ranks detach between the same two steps: nobody is left waiting, nothing is reported.
    ctl = memctl.Controller(model, opt, budget=BUDGET, **_options())
    for step in range(4):
        x, y = _data(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            ctl.detach()
    out["leave_together"] = {"errors": ctl.stats()["errors"],
                             "kinds": [e["kind"] for e in ctl.stats()["events"]]}


def _load_run(rank: int, out: dict[str, Any]) -> None:
    """Rank 0 alone loads a state it saved earlier: both ranks apply it at the same boundary."""
    from torch.nn.parallel import DistributedDataParallel

    import memctl

    torch.manual_seed(0)
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, budget=BUDGET, **_options())
    saved = None
    rows = []
    for step in range(6):
        if step == 2:
            saved = ctl.state_dict()
        if step == 4 and rank == 0:
            assert saved is not None
            ctl.load_state_dict(saved)
        if step == 4 and rank == 1:
            try:
                ctl.load_state_dict({"version": 99})
            except memctl.ConfigError as exc:
                out["bad_load"] = str(exc)
        x, y = _data(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        st = ctl.stats()
        rows.append({"step": st["step"], "budget": st["budget"],
                     "bits": {la["name"]: la["next_bits"] for la in st["layers"]}})
    out["load"] = {"rows": rows, "saved_step": saved["step"] if saved else None,
                   "kinds": [e["kind"] for e in ctl.stats()["events"]]}
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
        _calibrated_run(rank, out)
        _calibrated_run(rank, out, calibrate=False)
        _leave_run(rank, out)
        _load_run(rank, out)
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


# -- rank 0's aggregated view ----------------------------------------------------------------
def test_every_rank_has_a_row_in_the_aggregated_view(ranks: list[dict[str, Any]]) -> None:
    view = ranks[0]["ranks_view"]
    assert (view["rank"], view["world_size"], view["agreed"]) == (0, WORLD, True)
    rows = view["ranks"]
    assert [r["rank"] for r in rows] == [0, 1]
    last_allocation = (ranks[0]["rows_step"] - 1) // 2 * 2  # allocation_interval=2
    for row in rows:
        assert row["step"] == last_allocation
        assert row["raw_bytes"] > row["packed_bytes"] > 0
        assert row["ratio"] == pytest.approx(row["raw_bytes"] / row["packed_bytes"])
        assert 0 < row["avg_bits"] < 32
        assert row["budget_bytes"] == NEW_BUDGET
        assert row["agreed"] is True
    # Rank 1 capped its batch size during step OOM_STEP: its row shows what it asked for.
    assert rows[1]["batch_size"] == 5 < rows[0]["batch_size"]
    # Every rank gathered the same rows (the MIN all-reduce is an all-gather).
    assert ranks[1]["ranks_view"]["ranks"] == rows


def test_metrics_with_ranks_all_carry_every_ranks_series(ranks: list[dict[str, Any]]) -> None:
    text = ranks[0]["metrics_all"]
    for rank in range(WORLD):
        assert f'memctl_avg_bits{{rank="{rank}"}}' in text
        assert f'memctl_steps_total{{rank="{rank}"}}' in text
        assert f'memctl_rank_report_step{{rank="{rank}"}}' in text
    assert text.count("# TYPE memctl_avg_bits gauge") == 1
    # Without ?ranks=all a rank exports its own series only.
    assert 'rank="1"' not in ranks[0]["metrics"]


# -- calibration and the guard across ranks ---------------------------------------------------
def test_calibration_probes_and_guard_agree_across_ranks(ranks: list[dict[str, Any]]) -> None:
    c0, c1 = ranks[0]["calibrated"], ranks[1]["calibrated"]
    assert c0["steps"] == c1["steps"]  # bits, floors, measured variances, probes, guard actions
    last = c0["steps"][-1]
    assert last["probes"] == CAL_STEPS // 2  # one probe per allocation step (interval 2)
    assert sum(len(m) for m in last["measured"].values()) >= 4
    assert all(s["agreed"] for s in c0["steps"])
    assert c0["reference"] is not None and c0["reference"] > 0
    assert c0["events"] == c1["events"]
    assert c0["params"] == c1["params"]


def test_probes_and_the_view_add_no_collective(ranks: list[dict[str, Any]]) -> None:
    # One exchange per step, three more at each allocation step (0, 2, 4, 6): the probes'
    # figures, the guard's floors and the view's rows ride in those.
    for r in ranks:
        assert r["calibrated"]["collectives"] == CAL_STEPS + 3 * (CAL_STEPS // 2)


def test_probe_replays_leave_gradients_and_ddp_training_intact(ranks: list[dict[str, Any]]) -> None:
    # .grad after the boundary's replays is what DDP's all-reduce left there, and DDP trained on
    # after four probes (no reducer left expecting a backward) with parameters in sync.
    for r in ranks:
        assert r["calibrated"]["touched"] == [False] * CAL_STEPS
    assert ranks[0]["calibrated"]["params"] == ranks[1]["calibrated"]["params"]


def test_a_loss_turning_on_one_rank_raises_bits_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    g0, g1 = ranks[0]["loss_guard"], ranks[1]["loss_guard"]
    assert [s["guard_actions"] for s in g0["steps"]] == [s["guard_actions"] for s in g1["steps"]]
    assert g0["steps"][TURN_STEP - 1]["guard_actions"] == 0
    assert g0["steps"][TURN_STEP]["guard_actions"] == 1
    assert [e for e in g0["events"] if e[1] == "guard"] == [[TURN_STEP, "guard"]]
    assert g0["events"] == g1["events"]
    assert g0["steps"][TURN_STEP]["floors"] == g1["steps"][TURN_STEP]["floors"]
    assert any(f is not None for f in g0["steps"][TURN_STEP]["floors"].values())
    assert g0["steps"][-1]["bits"] == g1["steps"][-1]["bits"]


# -- detach and load under a process group ----------------------------------------------------
def test_a_rank_that_detaches_alone_is_reported_and_nobody_hangs(ranks: list[dict[str, Any]]) -> None:
    stay, gone = ranks[0]["leave"], ranks[1]["leave"]
    assert [r["attached"] for r in gone["rows"]] == [True] + [False] * 4
    assert [r["agreed"] for r in stay["rows"]] == [True, True, False, False, False]
    assert [r["step"] for r in stay["rows"]] == [1, 2, 3, 4, 5]
    assert stay["errors"] == 1
    assert len(stay["warnings"]) == 1
    assert "[1]" in stay["messages"][0] and "collective" in stay["messages"][0]
    assert "every rank between the same two optimizer steps" in stay["messages"][0]
    assert gone["errors"] == 0
    assert stay["params"] == gone["params"]  # DDP training went on in step


def test_ranks_that_detach_together_report_nothing(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["leave_together"]["errors"] == 0
        assert "error" not in r["leave_together"]["kinds"]


def test_a_state_loaded_on_rank_0_alone_is_applied_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    l0, l1 = ranks[0]["load"], ranks[1]["load"]
    assert l0["saved_step"] == 2
    # Loaded before step 4's forward; both ranks restart from step 2 at that step's boundary.
    assert [r["step"] for r in l0["rows"]] == [1, 2, 3, 4, 2, 3]
    assert l0["rows"] == l1["rows"]
    assert "load_state" in l1["kinds"]
    assert "no 'step' key" in ranks[1]["bad_load"]


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
        # No replay under FSDP2 (it would run FSDP's collectives), and the event says so.
        assert f["probes"] == 0 and "calibration_off" in f["kinds"]


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
