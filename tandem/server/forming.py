"""The server while its cluster forms (ranks starting, joining, loading their shards: minutes for a
large model), so the page can say so instead of the port refusing connections.

`tandem serve` binds its port at once with `AppSwitch(create_forming_app(...))`, then swaps in
`create_app(engine)` when the engine is up. The stand-in serves the page and `/v1/cluster` with the
state "forming", answers `/health` 503, and every other `/v1` route (and Ollama's `/api` ones) 503
`engine_unavailable`, behind the same API key the real app will check.
"""

from __future__ import annotations

import hmac
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tandem.server.cluster_view import ClusterView, Layout, render_cluster_metrics
from tandem.server.hosts import AllowedHosts, HostCheck
from tandem.server.http_limits import BodyLimit, HeadLimit, uvicorn_options
from tandem.server.page import add_static_routes
from tandem.server.protocol import APIError, error_response, keyed


class ServerStartError(RuntimeError):
    """The HTTP server could not start (its port was taken between the check and the bind)."""


class BackgroundServer:
    """uvicorn on its own thread, so the main thread can form the cluster meanwhile (the launcher
    ties its workers' lives to the thread that started them, which must outlive the group).
    Every request passes the head limits and the `Host` check (`allowed`; by default the names
    of `host`, `tandem.server.hosts`) before `app` sees it."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        graceful_s: float,
        allowed: AllowedHosts | None = None,
    ) -> None:
        allowed = allowed or AllowedHosts.for_bind(host)
        config = uvicorn.Config(
            HeadLimit(HostCheck(app, allowed)),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",  # the app is swapped while serving: no startup event to replay
            timeout_graceful_shutdown=graceful_s,  # open streams must not hold Ctrl-C up
            **uvicorn_options(),  # read deadline, keep-alive, head and connection limits
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="tandem-http", daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ServerStartError(
                    f"the HTTP server did not start on {self.server.config.host}:"
                    f"{self.server.config.port} (is the port taken?)"
                )
            time.sleep(0.02)

    def wait(self) -> None:
        """Until the server stops (Ctrl-C arrives in the caller as KeyboardInterrupt)."""
        while self.thread.is_alive():
            self.thread.join(0.5)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join((self.server.config.timeout_graceful_shutdown or 0) + 5.0)


class AppSwitch:
    """An ASGI app that hands every request to `self.app`, which may be replaced while serving
    (the switch is one attribute store; a request in flight finishes on the app it started on)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def create_forming_app(model_name: str, *, tp: int, pp: int, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="tandem (forming)", docs_url=None, redoc_url=None, openapi_url=None)
    started = time.time()
    detail = f"starting {tp * pp} rank(s) (tp={tp}, pp={pp}), loading their shards"

    def unavailable() -> APIError:
        return APIError(
            503,
            f"the cluster is forming ({detail}); try again shortly",
            type_="server_error",
            code="engine_unavailable",
        )

    @app.middleware("http")
    async def auth(request: Request, call_next):
        path = request.url.path
        if api_key and keyed(path):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                err = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
                return error_response(path, err)
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    app.add_middleware(BodyLimit)  # outermost, as in the real app
    add_static_routes(app)

    def view() -> ClusterView:
        kind = "single" if tp * pp == 1 else "tp" if pp == 1 else "pp"
        since = time.time() - started
        return ClusterView(
            model=model_name,
            state="forming",
            detail=f"{detail} ({since:.0f} s so far)",
            layout=Layout(kind=kind, tp=tp, pp=pp, world_size=tp * pp),
            ranks=[],
            links=[],
            running=0,
            waiting=0,
            generated_tokens=0,
            tokens_per_s=None,
            decode_ms_per_step=None,
            wait_seconds=0.0,
            wire_bytes=0,
            history=[],
            time=time.time(),
        )

    @app.get("/v1/cluster", response_model=ClusterView)
    async def cluster() -> ClusterView:
        return view()

    @app.get("/health")
    async def health():
        return JSONResponse(
            {"status": "unavailable", "state": "forming", "detail": view().detail}, 503
        )

    @app.get("/metrics")
    async def metrics():
        text = "# HELP tandem_healthy 1 when the cluster is whole.\n# TYPE tandem_healthy gauge\n"
        text += "tandem_healthy 0\n" + render_cluster_metrics(view())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST"])
    async def forming(rest: str):
        raise unavailable()

    @app.api_route("/api/{rest:path}", methods=["GET", "POST"])  # Ollama's: {"error": "..."}
    async def forming_ollama(rest: str):
        raise unavailable()

    return app
