"""The command line: demo end to end, status and budget against a live job, help."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import memctl
from memctl.cli import main


def test_demo_end_to_end(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "memctl", "demo", "--steps", "4", "--batch-size", "32",
         "--device", "cpu", "--out", str(tmp_path), "--tensorboard", str(tmp_path / "tb")],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "memctl API and dashboard at http://127.0.0.1:" in out.stdout
    for row in ("saved activations", "ratio vs full precision", "train loss (mean of last 4 steps)",
                "test accuracy", "step time"):
        assert row in out.stdout
    assert "final loss" not in out.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["baseline", "memctl"]
    base, mem = report["runs"]
    assert len(mem["losses"]) == 4
    assert mem["saved_bytes"] * 4 < base["saved_bytes"]
    assert report["memctl_stats"]["ratio"] > 4
    assert mem["train_loss_tail"] == pytest.approx(sum(mem["losses"]) / 4)
    # The table's ratio and the progress bar's last ratio are one number.
    ratio = f"{mem['saved_raw_bytes'] / mem['saved_bytes']:.1f}x"
    (table_row,) = [line for line in out.stdout.splitlines() if line.startswith("ratio vs full precision")]
    assert table_row.split()[-1] == ratio and mem["memory"][-1] == mem["saved_bytes"]
    bar = [part for part in out.stderr.replace("\r", "\n").splitlines()
           if "memctl" in part and "ratio=" in part]
    assert bar and bar[-1].split("ratio=")[1].split(",")[0].strip().rstrip("]") == ratio
    png = (tmp_path / "memory_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events and events[0]["kind"] == "attach" and {"step", "time", "kind", "message"} <= set(events[0])
    assert events == mem["events"]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"


def test_status_and_budget_commands(capsys: pytest.CaptureFixture[str]) -> None:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0)
    handle = ctl.serve()
    try:
        assert main(["status", "--url", handle.url]) == 0
        assert "step 0" in capsys.readouterr().out
        assert main(["budget", "2GiB", "--url", handle.url]) == 0
        assert json.loads(capsys.readouterr().out)["target_bytes"] == 2 * 2**30
        assert ctl.budget_info()["pending"] == "2GiB" or ctl.budget_info()["pending"] == 2 * 2**30
        assert main(["budget", "12XB", "--url", handle.url]) == 2
        assert "12XB" in capsys.readouterr().err
    finally:
        ctl.detach()
    assert main(["status", "--url", "http://127.0.0.1:9"]) == 2
    assert "cannot reach" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", [[], ["demo"], ["status"], ["budget"]])
def test_help(cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*cmd, "--help"])
    assert info.value.code == 0
    assert "usage: memctl" in capsys.readouterr().out


def test_demo_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--budget", "lots"]) == 2
    assert "lots" in capsys.readouterr().err
    assert main(["demo", "--steps", "0"]) == 2
