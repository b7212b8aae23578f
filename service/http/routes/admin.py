"""The operator's routes: liveness and readiness (open, for probes), metrics, stats, reload, and the
API docs where a key closes them."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from service.engine.runtime import Runtime
from service.engine.search_engine import ReloadError
from service.errors import NotFound, OverLimit
from service.http.routes.access import Access
from service.http.schemas import IndexInfo, ReloadRequest, Stats, Status


def router(runtime: Runtime, access: Access) -> APIRouter:
    settings = access.settings
    routes = APIRouter()

    @routes.get("/health", response_model=Status, summary="the process is alive")
    async def health() -> Status:
        return Status(status="alive")

    @routes.get("/ready", response_model=Status, responses={503: {"model": Status}},
                summary="the index is loaded and a real query has run")
    async def ready(response: Response, request: Request) -> Status:
        # Where a key is required, what is wrong and the index's details (paths, pids, its size) only to an admin
        # key: a probe without one learns the state alone.
        told = not access.keys.required or admin_key(request)
        if runtime.engine is None:
            response.status_code = 503
            return Status(status="failed" if runtime.load_error else "loading",
                          detail=runtime.load_error if told else None)
        # Ready either way: a failed reload leaves the previous index serving, and says why here.
        if not told:
            return Status(status="ready")
        detail = "; ".join(reason for reason in (runtime.reload_error, runtime.write_path_problems(), access.keys.error)
                           if reason) or None
        return Status(status="ready", detail=detail, index=IndexInfo(**runtime.engine.describe()))

    def admin_key(request: Request) -> bool:
        access.keys.refresh()
        given = request.headers.getlist("authorization")
        key = access.keys.of_header(given[0]) if len(given) == 1 else None
        return key is not None and key.allows("admin")

    # HEAD too, as load balancers' and probes' checks often ask (uvicorn sends no body for it).
    routes.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
    routes.add_api_route("/ready", ready, methods=["HEAD"], include_in_schema=False)

    @routes.get("/metrics", dependencies=access.guard("admin"), response_class=Response,
                responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"},
                           **{status: answer for status, answer in access.responses().items() if status in (401, 403)}})
    async def metrics() -> Response:
        return Response(runtime.monitor.exposition(), media_type=CONTENT_TYPE_LATEST)

    @routes.get("/stats", response_model=Stats, dependencies=access.guard("admin"), responses=access.responses())
    async def stats() -> Stats:
        engine = runtime.ready_engine()
        return Stats(**runtime.monitor.stats(), index=IndexInfo(**engine.describe()))

    @routes.post("/admin/reload", response_model=IndexInfo, dependencies=access.guard("admin"),
                 responses=access.responses({404: "no such folder in the index root"}))
    async def reload(request: ReloadRequest) -> IndexInfo:
        runtime.ready_engine()
        root = settings.reload_root
        try:
            target = (root / request.index).resolve()
            inside = target.is_relative_to(root) and target != root
            found = inside and target.is_dir()
        except (ValueError, OSError) as error:  # a NUL byte, a name too long for the file system
            raise OverLimit(("index",), f"index is not a usable folder name: {error}") from None
        if not inside:
            raise OverLimit(("index",), f"index must name a folder inside the index root {root}", request.index)
        if not found:
            raise NotFound(f"index: no folder {request.index!r} in the index root {root}")
        try:
            return IndexInfo(**await runtime.reload(target))
        except ReloadError as error:
            raise OverLimit(("index",), f"reload failed, the previous index keeps serving: {error}") from None

    return routes


def docs_router(app: FastAPI, access: Access) -> APIRouter:
    """/openapi.json, /docs and /redoc behind the key (FastAPI's own are turned off then)."""
    routes = APIRouter(dependencies=access.guard(None), include_in_schema=False)

    @routes.get("/openapi.json")
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @routes.get("/docs")
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @routes.get("/redoc")
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    return routes
