"""The app factory: one Runtime, the routers of service/http/routes, the error mapping and the middleware."""

from __future__ import annotations

import functools
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from retrieval.index_format import read_manifest
from service.engine.monitoring import RequestCounter
from service.engine.runtime import Runtime
from service.engine.search_engine import SearchEngine
from service.engine.tracing import Tracing
from service.http import limits, status
from service.http.admission import Admission, Occupancy
from service.http.keys import Keys
from service.http.routes import admin, embeddings, page, passages, rerank, search
from service.http.routes.access import Access
from service.http.routes.spec import spec_with_limits
from service.settings import ServiceSettings

log = logging.getLogger("service")


def create_app(settings: ServiceSettings | None = None, engine: SearchEngine | None = None,
               tracer_provider=None) -> FastAPI:
    """The app for `settings`; pass a loaded `engine` to skip loading (it is warmed up here), an
    OpenTelemetry `tracer_provider` to trace into it instead of SEARCH_OTLP_ENDPOINT's."""
    settings = settings or ServiceSettings()
    tracing = Tracing.from_settings(settings, tracer_provider)
    runtime = Runtime(settings, engine, tracing)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("settings: %s", settings.describe())
        runtime.start()
        yield
        # uvicorn has stopped taking connections and waited (up to SEARCH_DRAIN_TIMEOUT_S) for those under way.
        unanswered = app.state.occupancy.in_flight
        log.info("drained: %s; stopping", f"{unanswered} searches cut off" if unanswered else "every search answered")
        await runtime.close()

    def field_types():  # what a scoped key's filter may name: the served collection's fields
        engine = runtime.engine
        return engine.searcher.field_types if engine is not None else read_manifest(settings.index_dir).fields

    api_key = settings.api_key.get_secret_value() if settings.api_key is not None else None
    keys = Keys(api_key, settings.api_keys_file, field_types)  # KeysFileError for a keys file it cannot use
    # With a key, the docs and the spec need it too, unless SEARCH_OPEN_DOCS opens them.
    docs_open = not keys.required or settings.open_docs
    app = FastAPI(title="dense-search", version="0.1.0", lifespan=lifespan, telemetry=tracing.fastapi_config(),
                  description="Dense retrieval (RepBERT bi-encoder, exact FAISS search) over one index directory.",
                  **({} if docs_open else {"docs_url": None, "redoc_url": None, "openapi_url": None}))
    app.state.runtime, app.state.keys = runtime, keys
    # The searches in the service, against the cap: what the protocol and the middleware count and refuse.
    app.state.occupancy = Occupancy(settings.max_concurrent_requests, settings.retry_after_s, runtime.monitor, keys)
    runtime.monitor.in_flight.set_function(lambda: app.state.occupancy.in_flight)
    runtime.monitor.watch_key_in_flight(lambda: dict(app.state.occupancy.held))
    access = Access(settings, keys, runtime.monitor, tracing)
    page.mount_page(app, settings)
    routers = [admin.router(runtime, access), search.router(runtime, access), embeddings.router(runtime, access),
               rerank.router(runtime, access), passages.router(runtime, access),
               *([] if docs_open else [admin.docs_router(app, access)])]
    for routes in routers:
        app.include_router(routes)
    # The paths /metrics counts requests by (others are "unmatched").
    paths = {route.path for routes in routers for route in routes.routes} | {
        route.path for route in app.routes if hasattr(route, "path")}

    app.openapi = functools.partial(spec_with_limits, app, app.openapi, settings, runtime)
    status.install(app)
    app.add_middleware(limits.BodyLimits, max_bytes=settings.body_limit, timeout_s=settings.read_timeout_s)
    # Outside the body limits: an overloaded service refuses before reading a byte of the body.
    app.add_middleware(Admission, occupancy=app.state.occupancy)
    app.add_middleware(RequestCounter, monitor=runtime.monitor, paths=paths, audit=keys.scoped)
    return app
