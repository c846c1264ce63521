"""The console: ``GET /`` serves one page that draws this node's state.

Four static files from ``workers/http/console_files/`` (no build step, nothing from a
CDN: a node's host may have no internet). The page is plain JavaScript that
polls the node's own JSON endpoints (``/queue-state``, ``/accounting``,
``/leases``, ``/held``; ``fleet.js``: the same two with ``?scope=cluster``)
every 2 s and posts the operator's actions (``/admin/unhold``,
``/admin/pause``, ``/admin/resume``, ``/admin/run-now``) with the token the
operator pasted. See docs/console.md.

Hazards, and what we do about them:

- A page served by the node runs with the node's origin, so a script
  injected into it (a key or an error message drawn as HTML) could post
  admin actions. The page draws every value with ``textContent``, never as
  HTML, and every answer carries a Content-Security-Policy that allows only
  the node's own script, style and fetches: no inline script, no eval, no
  other origin, no framing.
- Only the files named in ``ASSETS`` are served, by name: no path from the
  request ever reaches the file system.
- The files are read at each request (they are small): an edited console
  shows on reload, and a missing file is a 404 naming it, not a crash.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from workers.http.errors import ApiError

CONSOLE_DIR = Path(__file__).resolve().parent / "console_files"

# name -> content type. The page and what it loads; nothing else is served.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "fleet.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}

# Strict, and still enough for the page: its own script and style files,
# fetches to its own origin, and the empty data: favicon (so the browser does
# not ask for /favicon.ico and log a 404).
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self' data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # The console changes with the node's version; never serve a stale one.
    "Cache-Control": "no-cache",
}

routes = web.RouteTableDef()


def _asset(name: str) -> web.Response:
    content_type = ASSETS.get(name)
    if content_type is None:
        raise ApiError(404, "not_found", f"no such console file: {name}")
    try:
        body = (CONSOLE_DIR / name).read_bytes()
    except FileNotFoundError:
        raise ApiError(404, "not_found", f"the console file {name} is not installed") from None
    response = web.Response(body=body, headers=SECURITY_HEADERS)
    # Set after construction: aiohttp's content_type argument cannot carry a charset.
    response.headers["Content-Type"] = content_type
    return response


@routes.get("/")
async def console_page(request: web.Request) -> web.Response:
    return _asset("index.html")


@routes.get("/console/{name}")
async def console_asset(request: web.Request) -> web.Response:
    return _asset(request.match_info["name"])
