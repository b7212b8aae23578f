"""/passages: writes over HTTP (SEARCH_WRITES), logged before they are answered and searched at once
(retrieval.writes): upsert a batch, delete by id or by filter, read one passage back. A write the log cannot
take is the runtime's WritesUnavailable (507 on a full disk, else 503)."""

from __future__ import annotations

from contextlib import contextmanager

from fastapi import APIRouter, Request

from retrieval.filters import FilterError
from retrieval.writes import WriteError
from service.engine.runtime import Runtime
from service.errors import NotFound, OverLimit
from service.http.routes.access import Access, key_of
from service.http.routes.bodies import JsonOffLoopRoute
from service.http.schemas import DeleteRequest, PassageResponse, UpsertRequest, WriteResponse


@contextmanager
def refused_writes():
    """A write's refusals as 422s naming the item and field."""
    try:
        yield
    except WriteError as error:
        raise OverLimit(error.path, str(error)) from None
    except FilterError as error:
        raise OverLimit(("filter", *error.path), str(error)) from None


def router(runtime: Runtime, access: Access) -> APIRouter:
    settings = access.settings
    routes = APIRouter(dependencies=access.guard("write"), route_class=JsonOffLoopRoute)
    shown = settings.writes

    def collection_count(scope: dict | None) -> int | None:
        """Passages in the collection once the write is in: not for a scoped key (it would count other scopes')."""
        return None if scope is not None else runtime.ready_engine().searcher.count

    refusals = {400: "this instance takes no writes (SEARCH_WRITES)"}
    unlogged = {**refusals, 503: "the index is loading, or the write log takes no writes now (the detail says why; "
                                 "Retry-After where a retry may succeed)",
                507: "the disk holding the write log is full: nothing of the write was kept"}

    @routes.post("/passages", response_model=WriteResponse, include_in_schema=shown,
                 responses=access.responses(unlogged), summary="upsert passages: logged, then searched at once")
    async def upsert(request: UpsertRequest, http: Request) -> WriteResponse:
        scope = key_of(http).scope
        if len(request.passages) > settings.max_write_passages:
            raise OverLimit(("passages",), f"{len(request.passages)} passages, over the max_write_passages limit of "
                                           f"{settings.max_write_passages} (SEARCH_MAX_WRITE_PASSAGES)")
        with refused_writes():
            passages = await runtime.check_upsert(request.passages, scope)
        tokens = await runtime.passage_tokens(passages)
        total = sum(len(text.ids) for text in tokens)
        if total > settings.max_write_tokens:
            raise OverLimit(("passages",), f"the passages make {total} tokens to encode, over the max_write_tokens "
                                           f"limit of {settings.max_write_tokens} (SEARCH_MAX_WRITE_TOKENS): send "
                                           "fewer at a time")
        with refused_writes():
            seq = await runtime.upsert(passages, tokens, scope)
        return WriteResponse(seq=seq, upserted=len(passages), count=collection_count(scope))

    @routes.post("/passages/delete", response_model=WriteResponse, include_in_schema=shown,
                 responses=access.responses(unlogged), summary="delete passages by id or by filter")
    async def delete(request: DeleteRequest, http: Request) -> WriteResponse:
        if (request.ids is None) == (request.filter is None):
            raise OverLimit(("ids",), "send ids or a filter (one of them)")
        with refused_writes():
            seq, deleted = await runtime.delete(request.ids, request.filter, key_of(http).scope)
        return WriteResponse(seq=seq, deleted=deleted, count=collection_count(key_of(http).scope))

    @routes.get("/passages/{pid:path}", response_model=PassageResponse, include_in_schema=shown,
                responses=access.responses({**refusals, 404: "the collection holds no passage of this id"}),
                summary="one passage, with its fields")
    async def passage(pid: str, http: Request) -> PassageResponse:
        found = runtime.ready_writes().get(pid, key_of(http).scope)  # outside the key's scope: as if absent
        if found is None:
            raise NotFound(f"no passage {pid!r}")
        return PassageResponse(id=found.id, text=found.text, fields=found.fields)

    return routes
