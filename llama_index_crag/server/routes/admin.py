"""The routes around the queries: health, Prometheus metrics, the recent answers, the API schema and the console."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import anyio
import torch
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from llama_index_crag.server.auth import CallerOf, require_api_key
from llama_index_crag.server.errors import ApiError
from llama_index_crag.server.schemas import (
    ERROR_RESPONSES,
    ErrorBody,
    GeneratorHealth,
    Health,
    QueryResult,
    RecentQueries,
)
from llama_index_crag.server.service import Service

STATIC = Path(__file__).resolve().parent.parent / "static"
#: The console's page runs only what the server itself sends.
CONSOLE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
}

#: Open to all: the health check, and the console's page (static HTML that holds no data and asks for the key).
public = APIRouter()
#: Behind the API key when the server has one.
guarded = APIRouter(dependencies=[Depends(require_api_key)], responses={401: ERROR_RESPONSES[401]})


class ConsoleFiles(StaticFiles):
    """The console's scripts and styles, under the same headers as its page."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(CONSOLE_HEADERS)
        return response


@public.get("/", include_in_schema=False)
async def console() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=CONSOLE_HEADERS)


@public.api_route(
    "/healthz",
    methods=["GET", "HEAD"],
    response_model=Health,
    responses={503: {"model": Health, "description": "Not ready."}},
)
async def healthz(service: Service, response: Response) -> Health:
    """200 when the index is loaded and the generator answers, else 503 naming what is not ready."""
    generator = service.generator
    # The probe is a blocking call (an HTTP request to Ollama, say): in a worker thread, off the event loop.
    ready, detail = await anyio.to_thread.run_sync(generator.probe)
    engine = service.engine
    response.status_code = 200 if ready else 503
    return Health(
        status="ok" if ready else "unavailable",
        index=service.index_info or {"ready": True},
        generator=GeneratorHealth(name=generator.name, label=generator.label, ready=ready, detail=detail),
        scorer=engine.grader.scorer.name,
        thresholds={"upper": engine.grader.upper, "lower": engine.grader.lower},
        threads=torch.get_num_threads(),
    )


@guarded.get("/metrics", response_class=Response)
async def prometheus(service: Service) -> Response:
    """Prometheus text exposition (every worker's, with ``--workers N``)."""
    body, content_type = service.metrics.exposition()
    return Response(body, media_type=content_type)


@guarded.get("/recent", response_model=RecentQueries)
async def recent(service: Service, caller: CallerOf) -> RecentQueries:
    """The caller's last answers on this worker, newest first (for the console); another key's are not shown."""
    return RecentQueries(queries=service.recent(caller))


@guarded.get(
    "/queries/{query_id}",
    response_model=QueryResult,
    responses={404: {"model": ErrorBody, "description": "Not among the caller's recent answers on this worker."}},
)
async def past(query_id: str, service: Service, caller: CallerOf) -> QueryResult:
    """One of the caller's recent answers, whole (another key's is not found, as an unknown id is not)."""
    found = service.past(caller, query_id)
    if found is None:
        raise ApiError(404, "not_found", f"no recent query {query_id!r} of yours on this worker")
    return found


@guarded.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> JSONResponse:
    """The API's schema (behind the key like the data it describes)."""
    schema: Dict[str, Any] = request.app.openapi()
    return JSONResponse(schema)
