from __future__ import annotations

import pytest

from memctl.api import ControllerView, StaticView, empty_snapshot
from memctl.api.view import SNAPSHOT_KEYS
from memctl.errors import BudgetError, ConfigError

from .conftest import DEVICE_TOTAL, populated_view


def test_static_view_satisfies_the_protocol() -> None:
    view = populated_view()
    assert isinstance(view, ControllerView)
    assert set(view.snapshot()) == set(SNAPSHOT_KEYS) == set(empty_snapshot())


def test_snapshot_is_immutable_and_detached() -> None:
    view = populated_view()
    snap = view.snapshot()
    with pytest.raises(TypeError):
        snap["step"] = 5  # type: ignore[index]
    snap["layers"][0]["bits"] = 99.0  # a copy: the published state is untouched
    assert view.snapshot()["layers"][0]["bits"] == 2.0


def test_request_budget_queues_until_the_step_boundary() -> None:
    view = StaticView(device_total_bytes=DEVICE_TOTAL)
    result = view.request_budget("10GiB")
    assert dict(result) == {"target": 10 * 2**30, "target_bytes": 10 * 2**30, "applies_at_step": 1,
                            "status": "pending"}
    assert view.budget_info()["pending"] == 10 * 2**30
    assert view.snapshot()["budget"] is None  # not applied yet
    applied = view.apply_pending()
    assert applied is not None and view.snapshot()["budget_bytes"] == 10 * 2**30
    assert view.snapshot()["step"] == 1 and view.budget_info()["pending"] is None
    view.request_budget("50%")
    view.apply_pending()
    assert view.budget_info()["target"] == "50%" and view.budget_info()["target_bytes"] == DEVICE_TOTAL // 2


@pytest.mark.parametrize("bad", ["12XB", -1, 0, True, [1], "9999TiB", "100GiB"])
def test_request_budget_rejects(bad: object) -> None:
    view = StaticView(device_total_bytes=DEVICE_TOTAL)
    with pytest.raises(BudgetError):
        view.request_budget(bad)
    assert view.budget_info()["pending"] is None


def test_percentage_needs_a_device_size() -> None:
    with pytest.raises(BudgetError, match="device's total memory is unknown"):
        StaticView().request_budget("75%")


def test_history_limit() -> None:
    view = populated_view()
    assert [s["time"] for s in view.history(3)] == [1005.0, 1006.0, 1007.0]
    assert len(view.history()) == 8
    with pytest.raises(ConfigError):
        view.history(0)


def test_unknown_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match="stepp"):
        StaticView({"stepp": 1})
    with pytest.raises(ConfigError, match="ratioo"):
        StaticView().publish(ratioo=1.0)
