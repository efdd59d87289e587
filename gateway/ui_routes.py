"""The operator page: ``/ui/``, three static files shipped in the package (``gateway/ui/``).

::

    GET /ui             redirects to /ui/ (so the page's relative URLs resolve under it)
    GET /ui/            index.html: the page's shell (a sign-in form until a key is accepted)
    GET /ui/app.js      the page's script (plain JavaScript, no framework, no build step)
    GET /ui/style.css   its style sheet

The files hold no data, so they are served without the API key (a browser cannot send a
header when it opens a URL); everything the page shows comes from routes that need the key
(:mod:`gateway.status_api`, ``/v1/agents``, ``/v1/scenarios``), which the script calls with
an ``x-api-key`` header. The key is typed into the form or given as ``/ui#key=KEY``: a
fragment never reaches the server (nor its logs); the script keeps the key in the tab's
``sessionStorage`` and removes the fragment from the address bar.

The files are read from the package once, when the app is built, and served from memory
with a Content-Security-Policy that lets the page load nothing but themselves and talk to
nothing but this server: no CDN, nothing fetched from elsewhere at run time.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route

__all__ = ["ui_routes", "is_public_ui_path", "UI_FILES", "SECURITY_HEADERS"]

UI_FILES: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
"""The page's files (in ``gateway/ui/``) and their content types."""

_PUBLIC = frozenset({"/ui", "/ui/", *(f"/ui/{name}" for name in UI_FILES if name != "index.html")})

SECURITY_HEADERS: dict[str, str] = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
"""Headers of every file of the page."""


def is_public_ui_path(path: str) -> bool:
    """Whether ``path`` is one of the page's static files, served without the API key."""
    return path in _PUBLIC


def _read(name: str) -> bytes:
    return resources.files("gateway").joinpath("ui", name).read_bytes()


def ui_routes() -> list[BaseRoute]:
    """The page's routes: one mount, so that the OpenAPI document (of the API) leaves them out."""
    files = {name: (_read(name), media_type) for name, media_type in UI_FILES.items()}

    def serve(name: str) -> Route:
        body, media_type = files[name]

        async def endpoint(request: Request) -> Response:
            return Response(body, media_type=media_type, headers=SECURITY_HEADERS)

        path = "/" if name == "index.html" else f"/{name}"
        return Route(path, endpoint, methods=["GET"], name=f"ui_{name.replace('.', '_')}")

    return [Mount("/ui", routes=[serve(name) for name in UI_FILES], name="ui")]
