"""Make docs/dashboard.png: train the demo's CNN for a while with memctl and photograph the dashboard.

Needs Chromium, chromedriver and selenium (as the dashboard's browser test does):

    python docs/dashboard_screenshot.py [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import shutil
import time

import torch
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

import memctl
from memctl.demo import DigitsNet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/dashboard.png")
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = DigitsNet()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctl = memctl.Controller(model, opt, budget="36MiB", monitor_interval_s=0.1, allocation_interval=10)
    url = ctl.serve().url
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1480",
                "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    service = Service(shutil.which("chromedriver") or "chromedriver")
    driver = webdriver.Chrome(service=service, options=options)
    try:
        driver.get(url + "/dashboard")
        for step in range(args.steps):
            if step == args.steps // 2:
                ctl.set_budget("28MiB")
            x, y = torch.randn(128, 1, 16, 16), torch.randint(0, 10, (128,))
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.05)
        time.sleep(2.5)  # two polls after the last step
        driver.save_screenshot(args.out)
    finally:
        driver.quit()
        ctl.detach()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
