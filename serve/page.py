"""The web page `jaxinfer serve` answers on GET /: a chat that streams through the server's own
/v1/chat/completions and a live dashboard polled from /v1/engine/stats.

The page is three static files shipped in the package (serve/webui/: no build step, no CDN, so it
works offline), read once when the app is made. They hold no secrets, so they are served without
the API key (PAGE_PATHS); the API calls the page makes need the key as any client's do. Every
answer carries a strict Content-Security-Policy: scripts, styles and connections from this origin
only, no inline script, no framing; the script never turns model text into HTML (it builds DOM
nodes with textContent), so model output that looks like markup stays text.
"""

from __future__ import annotations

import functools
import os

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; frame-ancestors 'none'")

ASSETS_PREFIX = "/webui/"
# file in serve/webui/ -> its content type; the page is index.html, on /
_ASSETS = {"index.html": "text/html; charset=utf-8",
           "app.js": "text/javascript; charset=utf-8",
           "style.css": "text/css; charset=utf-8"}
PAGE_PATHS = ("/",) + tuple(ASSETS_PREFIX + name for name in _ASSETS if name != "index.html")

_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
            "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
            "Cross-Origin-Opener-Policy": "same-origin",
            "Cross-Origin-Resource-Policy": "same-origin", "Cache-Control": "no-cache"}


def page_routes() -> list[Route]:
    """GET / (the page) and GET /webui/<file> (its script and style sheet)."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "webui")
    routes = []
    for name, content_type in _ASSETS.items():
        with open(os.path.join(folder, name), "rb") as f:
            body = f.read()
        path = "/" if name == "index.html" else ASSETS_PREFIX + name
        routes.append(Route(path, functools.partial(_asset, body, content_type), methods=["GET"]))
    return routes


async def _asset(body: bytes, content_type: str, request: Request) -> Response:
    return Response(body, headers={**_HEADERS, "Content-Type": content_type})
