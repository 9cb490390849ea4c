"""The command line: demo end to end, status and budget against a live job, help."""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import urllib.request
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
    assert report["options"]["lr_schedule"] == "cosine" and "cosine learning rate" in out.stdout


def test_demo_learning_rate_schedules(tmp_path: Path) -> None:
    """The cosine schedule steps after every update: the first two losses (before and after an
    update at 2e-3) match the constant schedule's, the third (after one at ~1.7e-3) does not."""
    from memctl.demo import DemoOptions, _train

    losses = {}
    for schedule in ("cosine", "constant"):
        opts = DemoOptions(steps=4, batch_size=32, device="cpu", out=str(tmp_path), progress=False,
                           lr_schedule=schedule)
        losses[schedule] = _train(opts, torch.device("cpu"), use_memctl=False, announce=print)[0].losses
    assert losses["cosine"][:2] == losses["constant"][:2]
    assert losses["cosine"][2] != losses["constant"][2]


def test_demo_rejects_an_unknown_schedule(tmp_path: Path) -> None:
    from memctl.demo import DemoOptions, check_options
    from memctl.errors import ConfigError

    with pytest.raises(ConfigError, match="--lr-schedule 'linear': must be one of cosine, constant"):
        check_options(DemoOptions(out=str(tmp_path), lr_schedule="linear"))
    with pytest.raises(SystemExit) as exit_info:  # argparse's choices
        main(["demo", "--lr-schedule", "linear"])
    assert exit_info.value.code == 2
    # the command line offers exactly the schedules the demo knows, the first as its default
    from memctl.cli import build_parser
    from memctl.demo import LR_SCHEDULES

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices["demo"]._actions if a.dest == "lr_schedule")
    assert tuple(action.choices or ()) == LR_SCHEDULES and action.default == LR_SCHEDULES[0]


def test_status_and_budget_commands(capsys: pytest.CaptureFixture[str]) -> None:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0)
    handle = ctl.serve()
    try:
        assert main(["status", "--url", handle.url]) == 0
        assert "step 0" in capsys.readouterr().out
        assert main(["budget", "2GiB", "--url", handle.url, "--json"]) == 0
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


# --- hostile input: one-line errors, before any training -------------------------------------

def test_bare_memctl_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: memctl" in capsys.readouterr().err


def _no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    import memctl.demo

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started before the options were checked")

    monkeypatch.setattr(memctl.demo, "_train", refuse)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--bits", "0"], "--bits 0"),
        (["--bits", "nan"], "--bits nan"),
        (["--port", "99999"], "--port 99999: must be in [0, 65535]"),
        (["--port", "-1"], "--port -1"),
        (["--budget", "1000TiB"], "more than the device's"),
        (["--budget", "10Gb"], "means bits"),
        (["--budget", "lots"], "lots"),
        (["--steps", "0"], "--steps 0"),
        (["--batch-size", "0"], "--batch-size 0"),
        (["--device", "graphics"], "device='graphics'"),
    ],
)
def test_demo_checks_every_option_before_training(args: list[str], needle: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _no_training(monkeypatch)
    assert main(["demo", "--no-progress", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("memctl: ") and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_demo_on_a_missing_gpu_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _no_training(monkeypatch)
    assert main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "there is no GPU" in err and err.count("\n") == 1


def test_demo_port_in_use_is_found_before_training(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _no_training(monkeypatch)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["demo", "--port", str(port), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1


def test_demo_errors_are_one_line_without_a_traceback() -> None:
    out = subprocess.run([sys.executable, "-m", "memctl", "demo", "--bits", "0", "--port", "99999"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr and out.stdout == ""


def test_a_negative_budget_is_parsed_and_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["budget", "-5GiB"], ["budget", "-5GiB", "--url", "http://127.0.0.1:9"],
                 ["budget", "--url", "127.0.0.1:9", "-0.5GiB"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "is negative" in err, err
    assert main(["budget"]) == 2
    assert "give one budget" in capsys.readouterr().err


def test_server_errors_are_sentences_and_urls_need_no_scheme(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMCTL_TOKEN", raising=False)
    model = torch.nn.Linear(8, 8)
    ctl = memctl.Controller(model, torch.optim.SGD(model.parameters(), lr=0.1), monitor_interval_s=0)
    handle = ctl.serve(token="tok-123")
    bare = f"127.0.0.1:{handle.port}"  # no scheme
    try:
        assert main(["budget", "1000TiB", "--url", bare, "--token", "tok-123"]) == 2
        err = capsys.readouterr().err
        assert "refused the request (422): target: budget '1000TiB' is 1000.00 TiB" in err
        assert "{" not in err and err.count("\n") == 1
        assert main(["budget", "1GiB", "--url", bare]) == 2
        assert "(401)" in capsys.readouterr().err.replace("refused the request ", "")
        assert main(["budget", "1GiB", "--url", f"localhost:{handle.port}/", "--token", "tok-123"]) == 0
        assert "budget 1.00 GiB" in capsys.readouterr().out
        assert main(["status", "--url", bare]) == 0
    finally:
        ctl.detach()


def test_status_shows_the_budget_split_in_readable_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    from memctl.controller.budget import format_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters())
    ctl = memctl.Controller(model, opt, budget="1GiB", monitor_interval_s=0, min_numel=64)
    handle = ctl.serve()
    try:
        for _ in range(2):
            model(torch.randn(32, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        with urllib.request.urlopen(handle.url + "/v1/stats", timeout=5) as response:
            s = json.loads(response.read())
        assert s["static_bytes"] > 0 and s["static_bytes"] == ctl.stats()["static_bytes"]
        assert s["other_bytes"] == ctl.stats()["other_bytes"]
        assert main(["status", "--url", handle.url]) == 0
        out = capsys.readouterr().out
    finally:
        ctl.detach()
    assert "step 2  budget 1.00 GiB  batch size" in out
    margin = 2**30 - s["static_bytes"] - s["activation_budget_bytes"]
    assert (f"budget split: static {format_bytes(s['static_bytes'])} (parameters, gradients, buffers, "
            f"optimizer state) + activations up to {format_bytes(s['activation_budget_bytes'])} "
            f"+ margin {format_bytes(margin)}") in out
    held = s["packed_bytes"] + s["other_bytes"]
    assert f"activations held {format_bytes(held)}" in out
    assert "not counted: the CUDA context, other processes" in out
    assert not re.search(r"\d{7,}", out), out  # no raw byte counts


def test_demo_warmup_steps_reach_the_controller_and_bad_ones_are_named(tmp_path: Path) -> None:
    from memctl.cli import build_parser
    from memctl.demo import DemoOptions, _train, check_options
    from memctl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--warmup-steps -3: warmup_steps=-3: must be an int >= 0"):
        check_options(DemoOptions(out=str(tmp_path), warmup_steps=-3))
    opts = DemoOptions(steps=3, batch_size=32, device="cpu", out=str(tmp_path), progress=False,
                       warmup_steps=2)
    _, stats, _ = _train(opts, torch.device("cpu"), use_memctl=True, announce=print)
    assert [e["step"] for e in stats["events"] if e["kind"] == "warmup"] == [2]
    assert build_parser().parse_args(["demo", "--warmup-steps", "50"]).warmup_steps == 50
