"""The live dashboard page and offline API docs, served by the same app.

``add_pages(app, token_required=...)`` adds:

- ``GET /`` and ``GET /dashboard``: one HTML page that polls ``/v1/stats``, ``/v1/layers``
  and ``/v1/history`` and draws activation bytes (raw vs packed), device memory against the
  budget, bits per layer (bars and a heat map over steps) and recent events, with a form
  that ``PUT``\\s ``/v1/budget`` (with a bearer token field when the server has a token);
- ``GET /dashboard/assets/{name}``: its script and style sheet;
- ``GET /docs``: Swagger UI from the ``swagger-ui-bundle`` package's own copy.

NOTE [ Nothing from the network ]
Training machines are often offline, and a page that pulls scripts from a CDN fails there
(and trusts a third party with a page that can change the budget). Every byte the
dashboard and ``/docs`` load comes from this package or from ``swagger-ui-bundle``: the
assets are read once, when the app is built, and served from memory by name (no file
system path comes from a request). The page uses relative URLs, so it also works behind
a proxy that serves the API under a path prefix.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

__all__ = ["add_pages", "dashboard_html"]

_ASSETS = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
_SWAGGER = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8",
            "swagger-ui.css": "text/css; charset=utf-8", "favicon-32x32.png": "image/png"}


def _static(name: str) -> bytes:
    return importlib.resources.files("memctl.api").joinpath("static", name).read_bytes()


def dashboard_html(token_required: bool) -> str:
    """The page, told whether the budget form needs a token."""
    html = _static("dashboard.html").decode()
    return html.replace("__TOKEN_REQUIRED__", "true" if token_required else "false")


def _swagger_assets() -> dict[str, bytes]:
    try:
        import swagger_ui_bundle  # type: ignore[import-untyped]  # ships no type information
    except ImportError:  # a broken install: /docs says so instead of pulling a CDN copy
        return {}
    root = Path(swagger_ui_bundle.swagger_ui_path)
    return {name: (root / name).read_bytes() for name in _SWAGGER if (root / name).is_file()}


def add_pages(app: FastAPI, *, token_required: bool) -> None:
    """Add the dashboard, its assets and the offline ``/docs`` (NOTE [ Nothing from the network ])."""
    page = dashboard_html(token_required).encode()
    assets = {name: _static(name) for name in _ASSETS}
    swagger = _swagger_assets()

    @app.get("/", include_in_schema=False)
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache", "Content-Security-Policy": _CSP})

    @app.get("/dashboard/assets/{name}", include_in_schema=False)
    async def dashboard_asset(name: str) -> Response:
        if name not in assets:
            raise HTTPException(status_code=404,
                                detail=f"no dashboard asset {name!r}; there are {sorted(assets)}")
        return Response(assets[name], media_type=_ASSETS[name])

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        if "swagger-ui-bundle.js" not in swagger:
            raise HTTPException(status_code=503,
                                detail="the API docs need swagger-ui-bundle: pip install swagger-ui-bundle")
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} API",
                                   swagger_js_url="docs/assets/swagger-ui-bundle.js",
                                   swagger_css_url="docs/assets/swagger-ui.css",
                                   swagger_favicon_url="docs/assets/favicon-32x32.png")

    @app.get("/docs/assets/{name}", include_in_schema=False)
    async def docs_asset(name: str) -> Response:
        if name not in swagger:
            raise HTTPException(status_code=404, detail=f"no docs asset {name!r}")
        return Response(swagger[name], media_type=_SWAGGER[name])


# Same-origin only: scripts, styles, images and requests (NOTE [ Nothing from the network ]).
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'self'; frame-ancestors 'self'")
