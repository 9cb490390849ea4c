"""Batch size: the adaptive batch sampler and the OOM guard."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import memctl
from memctl.controller.oom import split_batch
from tests.controller.models import MLP


class _FakeController:
    """Stands in for a controller whose batch size changes between batches."""

    def __init__(self, sizes: list[int]) -> None:
        self._sizes = sizes
        self.calls = 0

    @property
    def batch_size(self) -> int:
        self.calls += 1
        return self._sizes[(self.calls - 1) % len(self._sizes)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_sampler_never_skips_or_repeats_when_size_changes(shuffle: bool) -> None:
    ctl = _FakeController([3, 7, 1, 16, 5])
    sampler = memctl.AdaptiveBatchSampler(101, ctl, shuffle=shuffle, seed=3)  # type: ignore[arg-type]
    for _epoch in range(2):
        batches = list(sampler)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(101))
        assert len({len(b) for b in batches}) > 1


def test_sampler_follows_the_controller_in_a_dataloader() -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, budget="1GiB",
                            max_batch_size=48)
    ds = TensorDataset(torch.randn(200, 64), torch.randint(0, 10, (200,)))
    loader = DataLoader(ds, batch_sampler=memctl.AdaptiveBatchSampler(ds, ctl, batch_size=8, shuffle=False))
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert sizes[0] == 8
    assert max(sizes) == 48  # grew to the user's limit once the controller measured
    assert sum(sizes) == 200
    ctl.detach()


def test_sampler_drop_last_and_validation() -> None:
    ctl = _FakeController([4])
    sampler = memctl.AdaptiveBatchSampler(10, ctl, shuffle=False, drop_last=True)  # type: ignore[arg-type]
    assert [len(b) for b in sampler] == [4, 4]
    with pytest.raises(memctl.ConfigError, match="batch_size=0"):
        memctl.AdaptiveBatchSampler(10, ctl, batch_size=0)  # type: ignore[arg-type]


def test_split_batch_structures() -> None:
    batch = {"x": torch.arange(10), "y": (torch.arange(10), "tag")}
    parts = split_batch(batch, 3)
    assert [len(p["x"]) for p in parts] == [4, 3, 3]
    assert all(p["y"][1] == "tag" for p in parts)
    assert torch.cat([p["y"][0] for p in parts]).tolist() == list(range(10))


def test_oom_guard_splits_and_matches_full_batch_gradients() -> None:
    torch.manual_seed(0)
    ref = MLP()
    model = MLP()
    model.load_state_dict(ref.state_dict())
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    # reference: one full-batch step in plain PyTorch
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_grads = [p.grad.clone() for p in ref.parameters()]
    ref_opt.step()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, bits=8, min_numel=10**9)
    grads: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: grads.append([p.grad.clone() for p in model.parameters()]))
    calls: list[int] = []

    def compute_loss(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        bx, by = batch
        calls.append(len(bx))
        if len(bx) > 8:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return nn.functional.cross_entropy(model(bx), by)

    loss = ctl.guarded_step(compute_loss, (x, y))
    assert calls[:3] == [32, 16, 8]
    with torch.no_grad():
        ref_loss = float(nn.functional.cross_entropy(ref(x), y))
    assert loss == pytest.approx(ref_loss, rel=0.2)
    for g, r in zip(grads[0], ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-6)
    s = ctl.stats()
    assert s["step"] == 1
    assert s["batch_size"] == 8
    assert any(e["kind"] == "oom" for e in s["events"])
    ctl.detach()


def test_oom_guard_gives_up_with_a_clear_error() -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0)

    def always_oom(batch: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("injected")

    with pytest.raises(memctl.MemctlError, match="out of memory"):
        ctl.guarded_step(always_oom, torch.randn(4, 64))
    ctl.detach()
