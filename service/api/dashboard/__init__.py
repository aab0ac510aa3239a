"""The dashboard: a static page served by the API itself (``GET /`` and ``/ui/...``).

No build step and nothing fetched from the internet at run time: plain ES modules, one CSS
file and a vendored uPlot (``static/vendor/uplot``, MIT). The page reads the public REST API
with the token the user enters (kept in the browser's localStorage), so it needs no route or
privilege of its own; serving it requires no token, as it holds no data.

Only files that exist in ``static/`` when the module is imported are served, looked up by
exact name, so a request path can never reach outside the folder.
"""

from __future__ import annotations

import hashlib
import mimetypes
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

__all__ = ["STATIC_DIR", "router"]

STATIC_DIR = Path(__file__).resolve().parent / "static"

# Everything the page loads comes from this origin; the API is the only thing it talks to.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
}


@dataclass(frozen=True)
class _Asset:
    body: bytes
    media_type: str
    etag: str


def _load_assets(root: Path) -> dict[str, _Asset]:
    assets = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        body = path.read_bytes()
        media_type = _TYPES.get(path.suffix) or (
            mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        )
        etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
        assets[path.relative_to(root).as_posix()] = _Asset(body, media_type, etag)
    return assets


_ASSETS = _load_assets(STATIC_DIR)

router = APIRouter(include_in_schema=False)


def _serve(asset: _Asset, request: Request) -> Response:
    # Revalidate every time (cheap: an ETag match is a 304), so an upgrade shows at once.
    headers = {
        "ETag": asset.etag,
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": _CSP,
    }
    if request.headers.get("if-none-match") == asset.etag:
        return Response(status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.media_type, headers=headers)


@router.get("/", response_class=HTMLResponse)
def dashboard(request: Request) -> Response:
    """The dashboard page."""
    return _serve(_ASSETS["index.html"], request)


_SWAGGER = "/ui/vendor/swagger-ui"


@router.get("/docs", response_class=HTMLResponse)
def api_docs() -> Response:
    """Swagger UI for the OpenAPI schema, from the vendored copy (no CDN: works offline)."""
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="trainq API",
        swagger_js_url=f"{_SWAGGER}/swagger-ui-bundle.js",
        swagger_css_url=f"{_SWAGGER}/swagger-ui.css",
        swagger_favicon_url=f"{_SWAGGER}/favicon-32x32.png",
    )


@router.get("/ui/{path:path}")
def dashboard_asset(path: str, request: Request) -> Response:
    """A static file of the dashboard (scripts, styles, the vendored chart library)."""
    asset = _ASSETS.get(path)
    if asset is None:
        return Response("not found\n", status_code=404, media_type="text/plain")
    return _serve(asset, request)
