"""The web page: `GET /` (chat and cluster view), its static files, and `GET /v1/cluster`.

The page is plain HTML, ES modules and CSS shipped in the package (`static/`), read once. It holds
no data: everything it shows comes from `/v1/models`, `/v1/chat/completions` and `/v1/cluster`,
which the API key (when set) guards like every `/v1` route, so the page itself may load without a
key. Every response here carries a strict Content-Security-Policy: scripts only from this origin,
no inline script or style, no framing, requests only to this origin.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from tandem.engine.serving import ServingEngine
from tandem.server.cluster_view import ClusterMonitor, ClusterView
from tandem.server.protocol import APIError

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
MEDIA_TYPES[".css"] = "text/css; charset=utf-8"
STATIC_FILES = ("app.js", "api.js", "chat.js", "cluster.js", "plot.js", "style.css")


def _read(name: str) -> bytes:
    return resources.files("tandem.server").joinpath("static", name).read_bytes()


def _response(name: str, body: bytes) -> Response:
    media = MEDIA_TYPES[name[name.rindex(".") :]]
    return Response(body, media_type=media, headers=SECURITY_HEADERS)


def add_static_routes(app: FastAPI) -> None:
    """`GET /` and `GET /static/{name}` for the shipped files only."""
    files = {name: _read(name) for name in ("index.html", *STATIC_FILES)}

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return _response("index.html", files["index.html"])

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC_FILES:  # a fixed list: no path ever reaches the file system
            raise APIError(404, f"no static file {name!r}", code="not_found")
        return _response(name, files[name])


def add_page(app: FastAPI, engine: ServingEngine) -> ClusterMonitor:
    """Adds the page's routes to `app`; returns the monitor `/metrics` renders from too."""
    add_static_routes(app)
    monitor = ClusterMonitor(engine)

    @app.get("/v1/cluster", response_model=ClusterView)
    def cluster() -> ClusterView:  # a thread: describe() reads /proc for each local rank
        return monitor.view()

    return monitor
