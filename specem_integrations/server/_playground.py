"""The browser playground of ``specem serve``: ``GET /`` and its two assets, from package data.

One page of plain HTML, CSS and JavaScript (``static/``; no build step, no CDN, nothing fetched
from elsewhere, so it works offline). It talks to the server only through the public endpoints
(``POST /v1/chat/completions`` with the trace header, ``GET /v1/models``), so it needs no route
or privilege of its own, and an API key typed into it is sent like any client's.
"""

from __future__ import annotations

from importlib import resources

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

PAGE = "index.html"
ASSETS = {
    "playground.css": "text/css; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
}
"""Asset file name → content type (served under ``/playground/``)."""

# Same origin only: the page may load its own script and style and call its own API, nothing else
# (a model's answer is inserted as text; this is the second line of defence).
_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def _read(name: str) -> bytes:
    """A file of ``static/`` (raises ``FileNotFoundError`` naming it when the package lacks it)."""
    path = resources.files("specem_integrations.server").joinpath("static", name)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"the playground file static/{name} is missing from the installed package") from None


def playground_routes() -> list[Route]:
    """The routes of the playground (the files are read once, here).

    Raises:
        FileNotFoundError: a file of the page is missing from the installed package.
    """
    page = _read(PAGE)
    assets = {name: (_read(name), media_type) for name, media_type in ASSETS.items()}

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    async def asset(request: Request) -> Response:
        found = assets.get(request.path_params["name"])
        if found is None:
            raise HTTPException(404, "no such playground file")
        body, media_type = found
        return Response(body, media_type=media_type, headers=_HEADERS)

    return [
        Route("/", index, methods=["GET"]),
        Route("/playground/{name}", asset, methods=["GET"]),
    ]
