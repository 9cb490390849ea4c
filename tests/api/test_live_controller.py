"""A live server over a real training controller: the budget changes mid-run."""

from __future__ import annotations

import json
import urllib.request

import torch
from torch import nn

import memctl
from tests.controller.models import CNN, batch_for, loss_for


def _call(url: str, method: str = "GET", body: object = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_budget_put_over_http_applies_at_next_step() -> None:
    torch.manual_seed(0)
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctl = memctl.Controller(model, opt, min_numel=64, monitor_interval_s=0.05)
    handle = ctl.serve(port=0)
    try:
        assert handle.url.startswith("http://127.0.0.1:")

        def step(i: int) -> None:
            x, y = batch_for(model, n=8, seed=i)
            loss_for(model, model(x), y).backward()
            opt.step()
            opt.zero_grad()

        step(0)
        before = _call(handle.url + "/v1/stats")
        assert before["step"] == 1 and before["budget"] is None
        answer = _call(handle.url + "/v1/budget", "PUT", {"target": "512MiB"})
        assert answer["target_bytes"] == 512 * 2**20
        assert answer["applies_at_step"] == 2
        # not applied until the step boundary
        assert _call(handle.url + "/v1/budget")["target"] is None
        step(1)
        after = _call(handle.url + "/v1/stats")
        assert after["step"] == 2
        assert after["budget"] == 512 * 2**20
        assert after["activation_budget_bytes"] is not None
        assert after["allocation"]["step"] == 1  # re-solved at once at that boundary
        layers = _call(handle.url + "/v1/layers")
        rows = layers["layers"] if isinstance(layers, dict) else layers
        # (the stem saves only the image, kept by reference: NOTE [ Model inputs ])
        assert any(r["name"] == "bn" for r in rows), [r["name"] for r in rows]
        metrics = urllib.request.urlopen(handle.url + "/metrics", timeout=10).read().decode()
        assert "memctl_budget_bytes" in metrics
        history = _call(handle.url + "/v1/history")
        samples = history["samples"] if isinstance(history, dict) else history
        assert samples and samples[-1]["reader"] == "host"
    finally:
        ctl.detach()
    assert not handle.running


def test_bad_budget_over_http_is_a_422_and_changes_nothing() -> None:
    model = nn.Linear(4, 4)
    ctl = memctl.Controller(model, torch.optim.SGD(model.parameters(), lr=0.1), monitor_interval_s=0)
    handle = ctl.serve()
    try:
        req = urllib.request.Request(handle.url + "/v1/budget", data=b'{"target": "12XB"}', method="PUT",
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10)
            raise AssertionError("expected a 422")
        except urllib.error.HTTPError as exc:
            assert exc.code == 422
            assert "12XB" in exc.read().decode()
        assert ctl.budget_info()["pending"] is None
    finally:
        ctl.detach()
