"""The browser chat page: `GET /` (the page) and `GET /ui/*` (its CSS and JavaScript).

The page is plain files in `server/api/static/`, shipped as package data: no build step, no CDN,
so it works offline. It is a client like any other: it speaks only the documented `/v1/ws`
protocol and the public HTTP endpoints. `pagewire serve --no-ui` leaves these routes out.

The page gets a strict Content-Security-Policy: scripts and styles only from this origin and no
inline script, so even a rendering bug could not run script that came from model output (the
page itself never parses model text as HTML; see `static/markdown.js`).
"""
from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


async def _index(request: Request) -> Response:
    # no-cache: a browser revalidates the page after an upgrade instead of running stale JS.
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers={
        "content-security-policy": CSP, "cache-control": "no-cache",
        "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"})


def ui_routes() -> list[BaseRoute]:
    """Routes for the chat page; appended after the API routes so they never shadow them."""
    return [
        Route("/", _index, methods=["GET", "HEAD"]),
        Mount("/ui", StaticFiles(directory=STATIC_DIR), name="ui"),
    ]
