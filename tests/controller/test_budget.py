"""Budgets: parsing, the activation budget held from the step after a change, infeasibility."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import memctl
from memctl.controller.budget import BudgetSpec, parse_budget, resolve_budget
from tests.controller.models import CNN, batch_for, loss_for


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        (1024, 1024),
        ("12GiB", 12 * 2**30),
        ("800MB", 800 * 10**6),
        ("1.5G", int(1.5 * 2**30)),
        ("512 MiB", 512 * 2**20),
        ("4096", 4096),
        (2.0**20, 2**20),
    ],
)
def test_parse_sizes(text: object, nbytes: int) -> None:
    spec = parse_budget(text)
    assert spec is not None and spec.nbytes == nbytes


def test_parse_percent_and_none() -> None:
    spec = parse_budget("75%")
    assert spec == BudgetSpec(fraction=0.75)
    assert resolve_budget(spec, 1000) == 750
    assert parse_budget(None) is None
    with pytest.raises(memctl.BudgetError, match="percentage"):
        resolve_budget(spec, None)


@pytest.mark.parametrize(
    "bad", [0, -5, "0", "-1GiB", "12XB", "lots", "150%", "0%", True, [1], {"a": 1}, 1.5, "9999PiB",
            float("nan"), "GiB", ""]
)
def test_parse_rejects_and_names_the_value(bad: object) -> None:
    with pytest.raises(memctl.BudgetError) as info:
        parse_budget(bad)
    assert repr(bad)[:20].strip("'\"") in str(info.value) or str(bad) in str(info.value)


GIB24 = 24 * 2**30


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("1" + "0" * 400, "more than any device holds"),
        ("9" * 310 + "GiB", "more than any device holds"),
        (10**400, "more than any device holds"),
        ("0." + "0" * 60 + "1GiB", "at most 40"),
        ("1.5", "not a whole number of bytes"),
        (1.5, "not a whole number of bytes"),
        ("1.5B", "not a whole number of bytes"),
        ("0.5", "not a whole number of bytes"),
        ("0", "must be positive"),
        ("0GiB", "must be positive"),
        ("0.0000000001GiB", "must be positive"),
        ("10Gb", "lowercase 'b', which means bits"),
        ("10gb", "write '10GB'"),
        ("10Mb", "'10MiB'"),
        ("10b", "lowercase 'b'"),
        ("-5GiB", "is negative"),
        (" -1 ", "is negative"),
        (-1, "must be positive"),
        (float("nan"), "not a finite number"),
        (float("inf"), "not a finite number"),
        (float("-inf"), "not a finite number"),
        ("nan", "could not be parsed"),
        ("inf", "could not be parsed"),
        ("1e9", "could not be parsed"),
        ("", "is empty"),
        ("   ", "is empty"),
        ("\t\n", "is empty"),
        ("12 XB", "unknown unit 'XB'"),
    ],
)
def test_hostile_budgets_are_a_budget_error(value: object, needle: str) -> None:
    with pytest.raises(memctl.BudgetError, match=re.escape(needle)):
        parse_budget(value)


def test_one_rule_for_fractions_strings_and_json_numbers() -> None:
    # a bare number counts bytes and must be whole, whether a string or a number
    assert parse_budget("4096") == parse_budget(4096) == parse_budget(4096.0)
    # with a unit a fraction is fine, rounded down to whole bytes
    assert parse_budget("1.5GiB") == BudgetSpec(nbytes=3 * 2**29)
    assert parse_budget("1.0001KiB") == BudgetSpec(nbytes=1024)
    assert parse_budget("10kB") == parse_budget("10KB") == BudgetSpec(nbytes=10_000)
    assert parse_budget("10GB") == parse_budget("10gB") == BudgetSpec(nbytes=10 * 10**9)
    assert parse_budget("10GIB") == parse_budget("10G") == BudgetSpec(nbytes=10 * 2**30)


def test_a_percentage_that_rounds_to_zero_bytes_is_refused_like_zero() -> None:
    spec = parse_budget("0.0000000001%")
    with pytest.raises(memctl.BudgetError, match=r"0 bytes of this device's 24.00 GiB"):
        resolve_budget(spec, GIB24)
    assert resolve_budget(parse_budget("0.0000001%"), GIB24) == 25  # 25.77 bytes, rounded down


def test_budgets_above_the_device_are_refused_naming_both_values() -> None:
    with pytest.raises(memctl.BudgetError) as info:
        resolve_budget(parse_budget("1000TiB"), GIB24)
    message = str(info.value)
    assert "1000TiB" in message and "1000.00 TiB" in message and "24.00 GiB" in message
    assert str(GIB24) in message
    assert resolve_budget(parse_budget("24GiB"), GIB24) == GIB24
    assert resolve_budget(parse_budget("100%"), GIB24) == GIB24
    assert resolve_budget(parse_budget("1000TiB"), None) == 1000 * 2**40  # device size unknown


def test_a_controller_refuses_a_budget_above_its_device_before_attaching() -> None:
    model = nn.Linear(4, 4)
    total = memctl.controller.memory.device_total_bytes(torch.device("cpu"))
    assert total is not None
    with pytest.raises(memctl.BudgetError, match="more than the device's"):
        memctl.Controller(model, budget=total + 1, monitor_interval_s=0)
    assert not model._forward_pre_hooks and not model._forward_hooks  # nothing was attached
    ctl = memctl.Controller(model, monitor_interval_s=0)
    with pytest.raises(memctl.BudgetError, match="more than the device's"):
        ctl.set_budget(total + 1)
    assert ctl.budget_info()["pending"] is None
    ctl.detach()


def test_format_bytes_never_overflows() -> None:
    from memctl.controller.budget import format_bytes

    assert format_bytes(10**400) == "about 10^400 B"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(2**50) == "1.00 PiB"
    assert format_bytes(512) == "512 B"
    with pytest.raises(memctl.BudgetError, match="more than any device holds"):
        parse_budget(10**5000)  # past Python's int-to-str limit: the message must not need repr()


def _run(ctl: memctl.Controller, model: nn.Module, opt: torch.optim.Optimizer, steps: int,
         n: int = 32) -> list[int]:
    sizes = []
    for i in range(steps):
        x, y = batch_for(model, n=n, seed=i)
        loss_for(model, model(x), y).backward()
        opt.step()
        opt.zero_grad()
        s = ctl.stats()
        sizes.append(s["packed_bytes"] + s["other_bytes"])
    return sizes


@pytest.mark.parametrize(("solver", "used_by"), [("auto", {"dp", "trivial"}), ("milp", {"milp", "trivial"})])
def test_activation_bytes_stay_within_new_budget_from_next_step(solver: str, used_by: set[str]) -> None:
    torch.manual_seed(0)
    model = CNN(c=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # bits=2: the measurement below is "at two bits" (the default is the adaptive policy); a
    # generous solve time limit: which solver answers must not depend on the machine's load.
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, allocation_interval=1000,
                            solver=solver, bits=2, solver_time_limit_s=10.0)
    _run(ctl, model, opt, 2)
    static = ctl.stats()["static_bytes"]
    at_two_bits = ctl.stats()["packed_bytes"] + ctl.stats()["other_bytes"]
    margin = ctl.config.margin_fraction
    for target_act in (int(at_two_bits * 3), int(at_two_bits * 0.85)):
        # choose a device target whose activation budget is target_act
        target = int((target_act + static) / (1 - margin)) + 1
        ctl.set_budget(target)
        _run(ctl, model, opt, 1)  # the change applies at this step's boundary
        s = ctl.stats()
        assert s["budget"] == target
        assert s["activation_budget_bytes"] is not None
        assert s["allocation"]["feasible"], s["allocation"]
        assert s["allocation"]["solver"] in used_by, s["allocation"]
        used = _run(ctl, model, opt, 2)
        budget = ctl.stats()["activation_budget_bytes"]
        assert max(used) <= budget, (used, budget)
    # the tight budget forced fewer bits than 2 on average, the loose one allowed more
    assert ctl.stats()["avg_bits"] < 2.0
    ctl.detach()


def test_infeasible_budget_warns_and_recommends_a_smaller_batch() -> None:
    torch.manual_seed(0)
    model = CNN(c=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64)
    _run(ctl, model, opt, 1, n=32)
    static = ctl.stats()["static_bytes"]
    ctl.set_budget(int(static * 1.1) + 4096)
    with pytest.warns(RuntimeWarning, match="cannot be met"):
        _run(ctl, model, opt, 1, n=32)
    s = ctl.stats()
    assert any(e["kind"] == "budget_infeasible" for e in s["events"])
    assert s["batch_size"] is not None and s["batch_size"] < 32
    ctl.detach()


def test_batch_size_grows_with_budget() -> None:
    torch.manual_seed(0)
    model = CNN(c=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, budget="64MiB")
    _run(ctl, model, opt, 2, n=16)
    small = ctl.batch_size
    ctl.set_budget("256MiB")
    _run(ctl, model, opt, 1, n=16)
    assert small is not None and ctl.batch_size is not None
    assert ctl.batch_size > small > 16
    ctl.detach()


def test_budget_change_at_an_empty_step_reallocates_at_the_next_real_one() -> None:
    torch.manual_seed(0)
    model = CNN(c=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64, allocation_interval=1000)
    _run(ctl, model, opt, 1)
    first = ctl.stats()["allocation"]
    ctl.set_budget("128MiB")
    opt.step()  # a step boundary that saved nothing (no forward)
    assert ctl.stats()["budget"] == 128 * 2**20
    assert ctl.stats()["allocation"] == first
    _run(ctl, model, opt, 1)
    after = ctl.stats()["allocation"]
    assert after["step"] == 2 and after["reason"] == "budget change"
    ctl.detach()


def test_sparse_gradients_count_in_static_memory() -> None:
    """``nn.Embedding(sparse=True)``'s gradient has no storage to read: its indices and values
    are counted (the step boundary failed on it, every step, and no allocation was made)."""
    from memctl.controller.memory import tensor_bytes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 128, sparse=True), nn.Flatten(), nn.Linear(8 * 128, 4))
    dense = [p for n, p in model.named_parameters() if not n.startswith("0.")]
    sparse_opt = torch.optim.SparseAdam(list(model[0].parameters()), lr=1e-2)
    opt = torch.optim.Adam(dense, lr=1e-2)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0, calibration_fraction=0)
    tokens = torch.randint(0, 64, (16, 8))
    for _ in range(3):
        nn.functional.cross_entropy(model(tokens), tokens[:, 0] % 4).backward()
        sparse_opt.step()
        opt.step()
        sparse_opt.zero_grad()
        opt.zero_grad()
    s = ctl.stats()
    assert s["errors"] == 0 and s["allocation"] is not None
    grad = model[0](tokens).sum()
    grad.backward()
    g = model[0].weight.grad
    assert g is not None and g.is_sparse
    assert tensor_bytes(iter([g])) == g._indices().nbytes + g._values().nbytes
    ctl.detach()
