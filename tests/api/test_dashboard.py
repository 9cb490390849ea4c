"""The dashboard page and /docs over HTTP: served from the package, nothing loaded from elsewhere."""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi.testclient import TestClient

from memctl.api import StaticView

# Any absolute URL a page could load: a scheme, or a protocol-relative //host.
_EXTERNAL = re.compile(r"""(?:src|href)\s*=\s*["'](?:[a-z]+:)?//|url\(\s*["']?(?:[a-z]+:)?//|@import""", re.I)


def test_dashboard_page_and_assets_are_served_from_the_package(client: TestClient) -> None:
    for path in ("/", "/dashboard"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in r.headers["content-security-policy"]
        assert 'data-token-required="true"' in r.text  # the fixture's app has a token
        assets = re.findall(r'(?:src|href)="(dashboard/assets/[^"]+)"', r.text)
        assert sorted(assets) == ["dashboard/assets/dashboard.css", "dashboard/assets/dashboard.js"]
        assert not _EXTERNAL.search(r.text)
    js = client.get("/dashboard/assets/dashboard.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert 'fetch("v1/budget"' in js.text and "Authorization" in js.text
    assert not re.search(r"fetch\(\s*[\"']https?:", js.text)
    css = client.get("/dashboard/assets/dashboard.css")
    assert css.status_code == 200 and not _EXTERNAL.search(css.text)
    assert client.get("/dashboard/assets/../app.py").status_code == 404
    assert client.get("/dashboard/assets/dashboard.html").status_code == 404


def test_the_page_knows_when_no_token_is_needed(make_client: Callable[..., TestClient]) -> None:
    r = make_client(StaticView()).get("/dashboard")
    assert 'data-token-required="false"' in r.text


def test_docs_are_served_offline(client: TestClient) -> None:
    r = client.get("/docs")
    assert r.status_code == 200
    loaded = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert loaded and all(not re.match(r"(?:[a-z]+:)?//", url) for url in loaded), loaded
    for url in loaded:
        assert client.get("/" + url.lstrip("/")).status_code == 200, url
    assert client.get("/redoc").status_code == 404  # ReDoc would come from a CDN: not offered
    assert "/" not in client.get("/openapi.json").json()["paths"]  # the pages stay out of the API schema
