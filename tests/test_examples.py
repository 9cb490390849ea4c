"""The runnable examples (examples/, deploy/torchrun/) and the deployment files (deploy/).

The scripts run as real subprocesses, all started at once by one module fixture so that
their start-up (mostly Numba compiling the codec kernels, once per process) overlaps; each
test then waits for its own. The deployment files are parsed and checked against each other
and against the metric names memctl really exports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml  # type: ignore[import-untyped]  # PyYAML ships no stubs
from prometheus_client import generate_latest

from memctl.api import StaticView, build_registry

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
EXAMPLE = ROOT / "examples" / "train_cifar_like.py"
DDP = DEPLOY / "torchrun" / "train_ddp.py"
TIMEOUT_S = 300


@dataclass
class _Run:
    proc: subprocess.Popen[bytes]
    log: Path

    def wait(self) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill(self.proc)
            pytest.fail(f"{self.proc.args!r} did not finish in {TIMEOUT_S} s:\n{self.log.read_text()}")
        return rc, self.log.read_text()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the group of this run only (start_new_session)
        proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("examples")
    env = {k: v for k, v in os.environ.items() if k not in ("MEMCTL_TOKEN", "NUMBA_ENABLE_CUDASIM")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    ckpt = tmp / "ckpt" / "checkpoint.pt"
    commands = {
        "example": [sys.executable, str(EXAMPLE), "--steps", "4", "--log-every", "2", "--change-at", "2",
                    "--budget", "8MiB", "--new-budget", "4MiB", "--port", "0", "--device", "cpu",
                    "--resume-steps", "1", "--checkpoint", str(ckpt), "--samples", "256"],
        "ddp": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                "--nproc_per_node=2", str(DDP), "--steps", "2", "--device", "cpu", "--port", "0",
                "--log-every", "1", "--budget", "64MiB", "--samples", "256"],
        # A public address without MEMCTL_TOKEN must be refused before any training.
        "no_token": [sys.executable, str(EXAMPLE), "--host", "0.0.0.0", "--port", "0", "--device", "cpu"],
    }
    started: dict[str, Any] = {"checkpoint": ckpt}
    try:
        for name, cmd in commands.items():
            log = tmp / f"{name}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            started[name] = _Run(proc, log)
        yield started
    finally:
        for run in started.values():
            if isinstance(run, _Run):
                _kill(run.proc)


def test_example_trains_serves_changes_budget_and_resumes(runs: dict[str, Any]) -> None:
    rc, out = runs["example"].wait()
    assert rc == 0, out
    assert re.search(r"memctl API at http://127\.0\.0\.1:\d+", out), out
    assert re.search(r"^step +2 +loss [\d.]+ +batch", out, re.M), out
    assert "budget change queued: 4.00 MiB applies at step 3" in out, out
    assert re.search(r"^step +4 .*budget 4\.00 MiB$", out, re.M), out
    assert "trained 4 steps" in out
    assert "controller detached (attached: False)" in out
    assert "restored checkpoint: controller at step 4, budget 4.00 MiB" in out, out
    assert "after resuming: step 5" in out, out
    state = torch.load(runs["checkpoint"], weights_only=True)
    assert state["step"] == 4
    assert state["memctl"]["step"] == 4
    assert state["memctl"]["budget"] == 4 * 2**20
    assert state["memctl"]["layers"], "the controller's checkpoint holds no layer statistics"
    assert set(state["model"]) >= {"head.weight", "features.0.0.weight"}


def test_example_refuses_public_address_without_token(runs: dict[str, Any]) -> None:
    rc, out = runs["no_token"].wait()
    assert rc == 2, out
    assert "MEMCTL_TOKEN" in out and "refusing to serve on '0.0.0.0'" in out, out
    assert not re.search(r"^step ", out, re.M), "trained although the API could not start"


@pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch build has no torch.distributed")
def test_ddp_example_two_cpu_ranks(runs: dict[str, Any]) -> None:
    rc, out = runs["ddp"].wait()
    assert rc == 0, out
    assert "DDP over 2 process(es), backend gloo" in out, out
    assert len(re.findall(r"serves the memctl API at http://127\.0\.0\.1:\d+", out)) == 2, out
    for rank in (0, 1):
        assert re.search(rf"rank {rank} serves the memctl API", out), out
        assert re.search(rf"^rank {rank}: 2 steps .*budget 64\.00 MiB.*agreed True", out, re.M), out
    assert "parameters in sync across 2 rank(s): True" in out, out


# -- deployment files --------------------------------------------------------------------------


def _yaml(path: Path) -> list[Any]:
    return list(yaml.safe_load_all(path.read_text()))


def _exported_metric_names() -> set[str]:
    """Every metric family name memctl exports for a fully populated snapshot."""
    used = 30 * 2**30
    sample = {"time": 1.0, "reader": "nvml", "device": "cuda:0", "total_bytes": 80 * 2**30,
              "used_bytes": used, "free_bytes": 50 * 2**30, "process_bytes": used, "utilization": 50.0,
              "allocated_bytes": used, "reserved_bytes": used, "peak_bytes": used, "activation_bytes": 2**30}
    view = StaticView({
        "step": 3, "budget": "75%", "budget_bytes": 60 * 2**30, "activation_budget_bytes": 20 * 2**30,
        "raw_bytes": 8 * 2**30, "packed_bytes": 2**30, "ratio": 8.0, "avg_bits": 4.0, "batch_size": 64,
        "fallbacks": 1, "memory": sample,
        "allocation": {"solver": "milp", "status": "ok", "time_ms": 1.0, "objective": 0.5, "feasible": True,
                       "step": 2},
        "layers": [{"name": "conv1", "bits": 2.0, "error_bound": 0.1, "raw_bytes": 2**20,
                    "packed_bytes": 2**17, "sensitivity": 1.0}],
        "counters": {"events": {"allocation": 1}},
        "timings": {k: {"buckets": [[0.01, 1], [float("inf"), 1]], "sum": 0.005, "count": 1}
                    for k in ("step", "encode", "decode")},
        "rank": 0, "world_size": 2,
        "ranks": [{"rank": r, "step": 2, "raw_bytes": 8 * 2**30, "packed_bytes": 2**30, "other_bytes": 0,
                   "ratio": 8.0, "avg_bits": 4.0, "batch_size": 64, "budget_bytes": 60 * 2**30,
                   "activation_budget_bytes": 20 * 2**30, "static_bytes": 2**30, "process_bytes": used,
                   "device_used_bytes": used, "agreed": True, "fallbacks": 0, "errors": 0} for r in (0, 1)],
    })
    # What rank 0 exports with ?ranks=all (a superset of a rank's own families).
    text = generate_latest(build_registry(view, all_ranks=True)).decode()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {line.split("{")[0].split(" ")[0] for line in samples}


def test_grafana_dashboard_uses_exported_metrics_and_provisioned_datasource() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "memctl.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"memctl_[a-z_]+", e)}
    exported = _exported_metric_names()
    assert used <= exported, f"dashboard queries metrics memctl does not export: {sorted(used - exported)}"
    required = {"memctl_activation_packed_ratio", "memctl_activation_raw_bytes",
                "memctl_activation_packed_bytes",
                "memctl_avg_bits", "memctl_budget_bytes", "memctl_device_used_bytes", "memctl_batch_size",
                "memctl_codec_fallbacks_total", "memctl_layer_bits", "memctl_steps_total",
                "memctl_step_overhead_seconds_bucket", "memctl_codec_encode_seconds_bucket",
                "memctl_codec_decode_seconds_bucket", "memctl_events_total", "memctl_allocations_total",
                "memctl_budget_changes_total"}
    assert required <= used, f"dashboard lacks panels for {sorted(required - used)}"
    provisioning = DEPLOY / "grafana" / "provisioning"
    (source,) = _yaml(provisioning / "datasources" / "prometheus.yml")[0]["datasources"]
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    assert uids == {source["uid"]}
    assert source["url"] == "http://prometheus:9090"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    (provider,) = _yaml(provisioning / "dashboards" / "memctl.yml")[0]["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_compose_wires_trainer_prometheus_and_grafana() -> None:
    (compose,) = _yaml(DEPLOY / "docker-compose.yml")
    services = compose["services"]
    assert set(services) == {"trainer", "prometheus", "grafana"}
    trainer = services["trainer"]
    assert trainer["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
    assert "MEMCTL_TOKEN" in trainer["environment"]
    assert any(str(p).endswith(":8765") for p in trainer["ports"])
    (gpu,) = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"] and gpu["count"] == 1
    mounts = services["prometheus"]["volumes"] + services["grafana"]["volumes"]
    for mount in mounts:
        assert (DEPLOY / mount.split(":")[0]).exists(), f"compose mounts a missing path: {mount}"
    assert "/var/lib/grafana/dashboards" in " ".join(services["grafana"]["volumes"])
    (prom,) = _yaml(DEPLOY / "prometheus" / "prometheus.yml")
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["trainer:8765"]


def test_dockerfile_installs_cuda12_extra_as_non_root() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM .*cuda12", text, re.M) or re.search(r"^ARG BASE_IMAGE=.*cuda12", text, re.M)
    # The base image's torch is inside the supported range declared in pyproject.toml.
    base = re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:(\d+)\.(\d+)\.\d+-", text, re.M)
    assert base is not None
    torch_req = re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert torch_req is not None
    lo, hi = tuple(map(int, torch_req.groups()[:2])), tuple(map(int, torch_req.groups()[2:]))
    assert lo <= tuple(map(int, base.groups())) < hi
    # Dependencies in a cached layer: metadata and pins are copied, and installed, before the code.
    metadata = text.index("COPY pyproject.toml")
    deps = text.index('/src/deploy/constraints.txt "/src[cuda12]"')
    code = text.index("COPY . /src")
    assert metadata < deps < code
    assert "-c /tmp/torch-constraint.txt -c /src/deploy/constraints.txt" in text
    assert 'pip install --no-deps "/src"' in text[code:]
    pins = [line for line in (DEPLOY / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", p) for p in pins), pins
    assert re.search(r"^EXPOSE 8765$", text, re.M)
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and not user[-1].startswith(("root", "0")), "the image must not run as root"
    cmd = re.search(r"^CMD \[(.*?)\]$", text, re.M | re.S)
    assert cmd is not None
    args = json.loads("[" + cmd.group(1).replace("\\\n", " ") + "]")
    assert args[:2] == ["python", "examples/train_cifar_like.py"]
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[args.index("--port") + 1] == "8765"


def test_kubernetes_job_secret_and_service_fit_together() -> None:
    service, job = _yaml(DEPLOY / "kubernetes" / "job.yaml")
    (secret,) = _yaml(DEPLOY / "kubernetes" / "secret.example.yaml")
    assert (service["kind"], job["kind"], secret["kind"]) == ("Service", "Job", "Secret")
    pod = job["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    (token,) = [e for e in container["env"] if e["name"] == "MEMCTL_TOKEN"]
    ref = token["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8765
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    assert {p["containerPort"] for p in container["ports"]} == {8765}
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == "8765"
    assert notes["prometheus.io/path"] == "/metrics"
    # Scraped once: the Service must not be annotated as well.
    assert not any(k.startswith("prometheus.io/") for k in service["metadata"].get("annotations") or {})
    args = container["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_kubernetes_torchrun_job_serves_one_port_per_rank() -> None:
    service, job = _yaml(DEPLOY / "kubernetes" / "job-torchrun.yaml")
    (secret,) = _yaml(DEPLOY / "kubernetes" / "secret.example.yaml")
    pod = job["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    ranks = int(next(a for a in args if a.startswith("--nproc_per_node=")).split("=")[1])
    assert container["command"] == ["python", "-m", "torch.distributed.run"]
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert (ROOT / next(a for a in args if a.endswith(".py"))).is_file()  # the script torchrun starts
    base = int(args[args.index("--port") + 1])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == ranks
    # one named port per rank at base + LOCAL_RANK, in the pod and in the Service
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        f"rank-{r}": base + r for r in range(ranks)
    }
    assert {p["targetPort"]: p["port"] for p in service["spec"]["ports"]} == {
        f"rank-{r}": base + r for r in range(ranks)
    }
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (token,) = [e for e in container["env"] if e["name"] == "MEMCTL_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]


def test_grafana_dashboard_shows_one_series_per_rank() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "memctl.json").read_text())
    assert "rank" in {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            aggregated = target["expr"].startswith(("max by", "sum by", "min by"))
            assert aggregated or 'rank=~"$rank"' in target["expr"], target["expr"]
            assert aggregated or "{{rank}}" in target["legendFormat"], target
