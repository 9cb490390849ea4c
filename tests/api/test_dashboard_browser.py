"""The dashboard in a real headless Chromium (Selenium): numbers match /v1/stats, the budget form works.

Needs Chromium and its driver (Debian: ``apt-get install chromium chromium-driver``) and the
``selenium`` package (in the ``test`` extra); skipped, saying which is missing, otherwise.
``.ci/run`` installs all three.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import memctl

_CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
_DRIVER = shutil.which("chromedriver")
_TOKEN = "dashboard-test-token"

if _CHROMIUM is None or _DRIVER is None:
    pytest.skip("no Chromium/chromedriver on PATH (Debian: apt-get install chromium chromium-driver)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install 'memctl[test]')")


def _train(ctl: memctl.Controller, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x, y = torch.randn(64, 128), torch.randint(0, 4, (64,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def job() -> Iterator[tuple[memctl.Controller, torch.nn.Module, torch.optim.Optimizer, str]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctl = memctl.Controller(model, opt, bits=2.0, monitor_interval_s=0.05)
    _train(ctl, model, opt, 3)
    handle = ctl.serve(token=_TOKEN)
    try:
        yield ctl, model, opt, handle.url
    finally:
        ctl.detach()


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1800", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(_DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: Any, condition: Callable[[Any], Any], what: str, timeout: float = 30) -> Any:
    """``condition``'s first truthy value; a read of an element the page re-rendered meanwhile
    (it re-renders on every poll) is tried again."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=[StaleElementReferenceException])
    return wait.until(condition, message=f"waiting for {what}")


def _stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/v1/stats", timeout=10) as r:
        return json.loads(r.read())


def _value(driver: Any, element_id: str) -> str:
    return str(driver.find_element("id", element_id).get_attribute("data-value"))


def _reading(d: Any) -> dict[str, Any]:
    return {
        "step": _value(d, "step"), "ratio": _value(d, "ratio"),
        "ratio_text": d.find_element("id", "ratio").text,
        "avg_bits": _value(d, "avg-bits"), "raw_bytes": _value(d, "raw-bytes"),
        "packed_bytes": _value(d, "packed-bytes"), "budget": _value(d, "budget"),
        "budget_text": d.find_element("id", "budget").text,
        "bars": {b.get_attribute("data-layer"): float(b.get_attribute("data-bits"))
                 for b in d.find_elements("css selector", "#bits-chart .layer-bar")},
        "kinds": [row.get_attribute("data-kind")
                  for row in d.find_elements("css selector", "#events tbody tr")],
        "packed_path": bool(d.find_elements("css selector", "#activation-chart path[data-series='packed']")),
        "used_path": bool(d.find_elements("css selector", "#memory-chart path[data-series='used']")),
    }


def test_page_shows_the_stats_and_changes_the_budget(job: Any, browser: Any) -> None:
    ctl, model, opt, url = job
    stats = _stats(url)
    browser.get(url + "/dashboard")
    _wait(browser, lambda d: d.find_element("tag name", "body").get_attribute("data-rendered-step")
          == str(stats["step"]), "the page to render the current step")

    # The numbers on the page are /v1/stats' numbers (read in one reading, which the wait
    # repeats if the page re-renders an element between finding and reading it).
    page = _wait(browser, _reading, "a reading of the page")
    assert page["step"] == str(stats["step"]) == "3"
    assert float(page["ratio"]) == pytest.approx(stats["ratio"])
    assert page["ratio_text"] == f"{stats['ratio']:.2f}×"
    assert float(page["avg_bits"]) == pytest.approx(stats["avg_bits"])
    assert int(page["raw_bytes"]) == stats["raw_bytes"]
    assert int(page["packed_bytes"]) == stats["packed_bytes"]
    assert page["budget"] == "" and page["budget_text"] == "none"
    bars = page["bars"]
    assert bars and bars == {layer["name"]: pytest.approx(layer["bits"]) for layer in ctl.stats()["layers"]
                             if layer["bits"] is not None}
    kinds = page["kinds"]
    assert kinds == [e["kind"] for e in stats["events"]][::-1][:20] and "attach" in kinds
    assert page["packed_path"] and page["used_path"]

    # A wrong token is refused and says so; nothing is queued.
    assert browser.find_element("id", "token-label").is_displayed()
    browser.find_element("id", "budget-input").send_keys("3GiB")
    browser.find_element("id", "token-input").send_keys("wrong")
    browser.find_element("id", "budget-apply").click()
    _wait(browser, lambda d: d.find_element("id", "budget-result").get_attribute("data-state") == "error",
          "the refusal")
    assert "refused" in browser.find_element("id", "budget-result").text
    assert ctl.budget_info()["pending"] is None

    # With the token the change reaches the controller, and the page shows it once applied.
    browser.find_element("id", "token-input").clear()
    browser.find_element("id", "token-input").send_keys(_TOKEN)
    browser.find_element("id", "budget-apply").click()
    _wait(browser, lambda d: d.find_element("id", "budget-result").get_attribute("data-state") == "ok",
          "the budget change to be accepted")
    assert ctl.budget_info()["pending"] == 3 * 2**30
    _train(ctl, model, opt, 1)
    assert ctl.stats()["budget_bytes"] == 3 * 2**30
    _wait(browser, lambda d: _value(d, "budget") == str(3 * 2**30), "the new budget on the page")
    assert browser.find_element("id", "budget").text == "3.00 GiB"
    _wait(browser, lambda d: d.find_elements("css selector", "#events tbody tr[data-kind='budget']"),
          "the budget event")

    # Everything the page loaded came from the job's own server, and the page's CSP was never hit.
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(name.startswith(url + "/") for name in loaded), loaded
    refused = "/v1/budget - Failed to load resource: the server responded with a status of 403"
    problems = [e["message"] for e in browser.get_log("browser")
                if e["level"] == "SEVERE" and refused not in e["message"]]  # the wrong token's 403
    assert not problems, problems


def test_page_shows_a_row_per_rank_when_the_job_has_several(browser: Any) -> None:
    from memctl.api import StaticView, serve

    rows = [
        {"rank": r, "step": 40, "raw_bytes": 8000, "packed_bytes": 1000 + 600 * r, "other_bytes": 0,
         "ratio": 8000 / (1000 + 600 * r), "avg_bits": 4.0 - r, "batch_size": 64 // (r + 1),
         "budget_bytes": 2**20, "activation_budget_bytes": 2**19, "static_bytes": 2**18,
         "process_bytes": None if r else 3 * 2**20, "device_used_bytes": None, "agreed": r == 0,
         "fallbacks": 0, "errors": 0}
        for r in range(2)
    ]
    view = StaticView({"step": 42, "rank": 0, "world_size": 2, "ranks": rows})
    handle = serve(view)
    try:
        browser.get(handle.url + "/dashboard")
        def table(d: Any) -> list[tuple[str | None, str | None, list[str | None]]]:
            """The rows as one reading: (data-rank, data-agreed, each cell's data-value)."""
            return [(tr.get_attribute("data-rank"), tr.get_attribute("data-agreed"),
                     [td.get_attribute("data-value") for td in tr.find_elements("tag name", "td")])
                    for tr in d.find_elements("css selector", "#ranks tbody tr")]

        shown = _wait(browser, table, "the rank rows")
        assert browser.find_element("id", "ranks-panel").is_displayed()
        assert [rank for rank, _, _ in shown] == ["0", "1"]
        cells = [row for _, _, row in shown]
        assert cells[1][:3] == ["1", "40", "3"] and cells[1][4] == "1600" and cells[1][5] == ""
        assert float(cells[0][3]) == pytest.approx(8.0)
        assert shown[1][1] == "false"
        assert "rank 0" in browser.find_element("id", "ranks-note").text
    finally:
        handle.close()

    # A single process shows no rank table.
    single = serve(StaticView({"step": 3}))
    try:
        browser.get(single.url + "/dashboard")
        _wait(browser, lambda d: d.find_element("tag name", "body").get_attribute("data-rendered-step")
              == "3", "the page to render")
        assert not browser.find_element("id", "ranks-panel").is_displayed()
    finally:
        single.close()
