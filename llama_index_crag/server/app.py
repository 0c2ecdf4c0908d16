"""The query server: a JSON and SSE API, an OpenAI-compatible chat endpoint, Prometheus metrics and the console.

``create_app(engine, ...)`` wraps any ``CorrectiveQueryEngine``; ``llama-crag serve`` builds
one over a persisted index folder (``llama-crag ingest``). Routes:

- ``POST /query`` ``{"query": str, "explain": bool, "stream": bool}``: the answer, its sources and
  the whole decision trace; with ``"stream": true``, server-sent events (``token`` events,
  then one ``result`` event holding everything, or an ``error`` event).
- ``POST /v1/chat/completions``: OpenAI's chat format, streaming or not; the last user
  message is the question, the trace travels in the extra ``crag`` field, and an
  abstention is an ordinary assistant message.
- ``GET /metrics`` (Prometheus), ``GET /healthz``, ``GET /recent`` and ``GET /queries/{id}``
  (the last answers, for the console), ``GET /`` (the console).

Safe by default: the CLI binds to 127.0.0.1; ``CRAG_API_KEY`` (or ``api_key=``) guards
every data route (``Authorization: Bearer KEY`` or ``X-API-Key``) but ``/healthz`` and the
console's static page, which holds no data and asks for the key; bodies and queries have
size limits; CORS is off unless origins are given. Every error is JSON in OpenAI's shape,
``{"error": {"type", "code", "message"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Deque, Dict, List, Optional, Tuple

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llama_index_crag.core.engine import CorrectiveQueryEngine
from llama_index_crag.core.fallback import SOURCE_KEY
from llama_index_crag.errors import GenerationError, InvalidQueryError, RetrievalUnavailableError
from llama_index_crag.server.metrics import ServerMetrics
from llama_index_crag.stores.chunking import clean_text

log = logging.getLogger("llama_index_crag.server")
STATIC = Path(__file__).parent / "static"
#: Characters of a source's text returned as its excerpt.
EXCERPT_CHARS = 600
_END = object()


@dataclass
class ServerConfig:
    """The server's limits and options (the CLI's flags)."""

    api_key: Optional[str] = None
    max_body_bytes: int = 64 * 1024
    query_timeout_s: float = 120.0
    cors_origins: List[str] = field(default_factory=list)
    recent: int = 50
    rate_window_s: float = 300.0
    model_name: str = "llama-index-crag"


class ApiError(Exception):
    """An error answered as JSON with its HTTP status."""

    def __init__(self, status: int, code: str, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.kind = status, code, message, kind

    @classmethod
    def mid_stream(cls, exc: Exception) -> ApiError:
        """What a failure after the stream began is reported as (its status line is already sent)."""
        return exc if isinstance(exc, ApiError) else cls(503, "generator_failed", str(exc), "server_error")

    def body(self) -> Dict[str, Any]:
        return {"error": {"type": self.kind, "code": self.code, "message": self.message}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class QueryRequest(BaseModel):
    """``POST /query``."""

    model_config = ConfigDict(extra="forbid")
    query: StrictStr = Field(description="The question.")
    explain: StrictBool = Field(default=False, description="Add the scorer's explanation of each grade.")
    stream: StrictBool = Field(default=False, description="Answer as server-sent events.")


class ChatMessage(BaseModel):
    role: StrictStr
    content: Any = None


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions`` (the fields this server reads; others are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")
    model: Optional[StrictStr] = None
    messages: List[ChatMessage] = Field(min_length=1)
    stream: StrictBool = False


@dataclass
class Generator:
    """The generator as the health check reports it: a name and a probe saying whether it is ready."""

    name: str
    probe: Callable[[], Tuple[bool, str]] = lambda: (True, "loaded")


class _BodyLimit:
    """ASGI middleware: refuse a request body over ``limit`` bytes with 413, declared or streamed."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)  # no body is read: the app's receive stays untouched
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = ApiError(413, "body_too_large", f"the request body is over the limit of {self.limit:,} bytes")
        try:
            if declared is not None and int(declared) > self.limit:
                await too_big.response()(scope, receive, send)
                return
        except ValueError:
            await ApiError(400, "bad_content_length", "the Content-Length header is not a number").response()(
                scope, receive, send
            )
            return
        # Read the whole body first (it is small by design), counting as it comes: a chunked body without a
        # Content-Length meets the same limit, and the app never sees a body it would have to refuse half-read.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await too_big.response()(scope, receive, send)
                return
        replayed = False

        async def replay() -> Dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class QueryService:
    """Runs queries through the engine (variants for streaming and explanations) and keeps the recent ones."""

    def __init__(self, engine: CorrectiveQueryEngine, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine, self.config, self.metrics = engine, config, metrics
        self._variants: Dict[Tuple[bool, bool], CorrectiveQueryEngine] = {}
        self.recent: Deque[Dict[str, Any]] = deque(maxlen=config.recent)
        self.results: OrderedDict[str, Dict[str, Any]] = OrderedDict()

    def variant(self, stream: bool, explain: bool) -> CorrectiveQueryEngine:
        key = (stream, explain)
        if key not in self._variants:
            self._variants[key] = self.engine.variant(streaming=stream, explain=explain)
        return self._variants[key]

    def check(self, query: Any) -> str:
        if isinstance(query, str):
            query = clean_text(query)
        if not isinstance(query, str) or not query.strip():
            raise ApiError(400, "empty_query", "the query is empty: send a question in the 'query' field")
        # The engine's own limit (one value for both): checked here as well to refuse before taking a worker thread.
        limit = self.engine.settings.max_query_chars
        if len(query) > limit:
            raise ApiError(
                400, "query_too_long", f"the query is {len(query):,} characters, over the limit of {limit:,}"
            )
        return query

    async def run(self, query: str, explain: bool, stream: bool, deadline: float) -> Any:
        """The engine's response (streaming or not), or an ``ApiError``."""
        engine = self.variant(stream, explain)
        try:
            return await asyncio.wait_for(
                anyio.to_thread.run_sync(engine.query, query), max(0.0, deadline - time.monotonic())
            )
        except asyncio.TimeoutError:
            raise self._timeout() from None
        except InvalidQueryError as exc:
            raise ApiError(400, "invalid_query", str(exc)) from exc
        except GenerationError as exc:
            raise ApiError(503, "generator_unavailable", str(exc), "server_error") from exc
        except RetrievalUnavailableError as exc:
            raise ApiError(503, "retrieval_unavailable", str(exc), "server_error") from exc

    def _timeout(self) -> ApiError:
        return ApiError(
            504,
            "query_timeout",
            f"the query ran past its budget of {self.config.query_timeout_s:g} s and was cut off",
            "server_error",
        )

    async def first_token(self, response: Any, deadline: float) -> Tuple[Any, Any]:
        """Pull the first token of a streaming response here, so that a dead generator still gets its 503."""
        generator = iter(response.response_gen)
        try:
            first = await asyncio.wait_for(
                anyio.to_thread.run_sync(next, generator, _END), max(0.0, deadline - time.monotonic())
            )
        except asyncio.TimeoutError:
            raise self._timeout() from None
        except Exception as exc:
            raise ApiError(
                503, "generator_unavailable", f"the generator failed: {type(exc).__name__}: {exc}", "server_error"
            ) from exc
        return generator, first

    async def tokens(self, generator: Any, first: Any, deadline: float) -> AsyncIterator[str]:
        token = first
        while token is not _END:
            yield str(token)
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout()
            try:
                token = await asyncio.wait_for(anyio.to_thread.run_sync(next, generator, _END), left)
            except asyncio.TimeoutError:
                raise self._timeout() from None

    def record(self, query: str, answer: str, response: Any, started: float) -> Dict[str, Any]:
        """The JSON result of an answered query; remembered for ``/recent`` and counted in the metrics."""
        trace = dict(response.metadata["crag"])
        elapsed = round((time.monotonic() - started) * 1000.0, 1)
        result = {
            "id": f"q-{uuid.uuid4().hex[:12]}",
            "created": int(time.time()),
            "query": query,
            "answer": answer,
            "abstained": trace["abstained"],
            "action": trace["action"],
            "answered_by": trace.get("answered_by"),
            "grounded": trace.get("grounded"),
            "sources": [_source(n, trace) for n in response.source_nodes or []],
            "elapsed_ms": elapsed,
            "crag": trace,
        }
        self.metrics.observe(trace, elapsed / 1000.0)
        self.recent.appendleft(
            {k: result[k] for k in ("id", "created", "query", "action", "abstained", "elapsed_ms")}
            | {"top_score": trace.get("top_score")}
        )
        self.results[result["id"]] = result
        while len(self.results) > self.config.recent:
            self.results.popitem(last=False)
        return result


def _answer(response: Any) -> str:
    """The generated text ("" when nothing generates: grading-only serving)."""
    return "" if getattr(response, "response", None) is None else str(response.response)


def _source(node: Any, trace: Dict[str, Any]) -> Dict[str, Any]:
    inner = node.node
    origin = inner.metadata.get(SOURCE_KEY) or "primary"
    original = inner.node_id.split("#strips")[0]
    graded = [g for g in trace.get("nodes", []) if g["node_id"] in (inner.node_id, original)]
    text = inner.get_content()
    return {
        "id": inner.node_id,
        "doc_id": inner.metadata.get("doc_id") or inner.ref_doc_id,
        "excerpt": text[:EXCERPT_CHARS] + ("…" if len(text) > EXCERPT_CHARS else ""),
        "score": None if node.score is None else round(float(node.score), 4),
        "label": graded[-1]["label"] if graded else None,
        "origin": "primary" if origin == "retriever" else origin,
        "refined": inner.node_id.endswith("#strips"),
        "url": inner.metadata.get("url"),
    }


def _chat_query(request: ChatRequest) -> str:
    for message in reversed(request.messages):
        if message.role == "user":
            content = message.content
            if isinstance(content, list):  # content parts: keep the text ones
                content = "\n".join(
                    p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
                )
            if not isinstance(content, str):
                raise ApiError(400, "invalid_message", "the last user message has no text content")
            return content
    raise ApiError(400, "no_user_message", "messages holds no message with role 'user': nothing to answer")


def create_app(
    engine: CorrectiveQueryEngine,
    config: Optional[ServerConfig] = None,
    generator: Optional[Generator] = None,
    index_info: Optional[Dict[str, Any]] = None,
) -> FastAPI:
    """The ASGI app around ``engine``. ``generator`` says what generates (for ``/healthz``); ``index_info``
    describes the loaded index."""
    config = config or ServerConfig()
    metrics = ServerMetrics(config.rate_window_s)
    service = QueryService(engine, config, metrics)
    generator = generator or Generator(name=type(getattr(engine.synthesizer, "_llm", None)).__name__)
    app = FastAPI(title="llama-index-crag", version="1", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.service = service

    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-API-Key"],
        )

    open_paths = ("/healthz", "/", "/favicon.ico")

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Any]) -> Response:
        started = time.monotonic()
        path = request.url.path
        if config.api_key and not (path in open_paths or path.startswith("/static/")):
            given = request.headers.get("x-api-key") or ""
            auth = request.headers.get("authorization") or ""
            if auth.lower().startswith("bearer "):
                given = auth[7:].strip()
            if not hmac.compare_digest(given.encode(), config.api_key.encode()):
                response: Response = ApiError(
                    401,
                    "unauthorized",
                    "this server needs an API key: Authorization: Bearer KEY or X-API-Key",
                    "authentication_error",
                ).response()
                metrics.request(path, response.status_code, time.monotonic() - started)
                return response
        response = await call_next(request)
        if path == "/" or path.startswith("/static/"):
            response.headers["Content-Security-Policy"] = (
                "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
            )
            response.headers["X-Content-Type-Options"] = "nosniff"
        metrics.request(path, response.status_code, time.monotonic() - started)
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for error in exc.errors():
            where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {error.get('msg')}")
        return ApiError(422, "invalid_request", "; ".join(problems) or "the request body is not valid").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return ApiError(exc.status_code, code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("query failed")
        return ApiError(500, "internal_error", f"{type(exc).__name__}: {exc}", "server_error").response()

    @app.get("/", include_in_schema=False)
    async def console() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        ready, detail = await anyio.to_thread.run_sync(generator.probe)
        body = {
            "status": "ok" if ready else "unavailable",
            "index": index_info or {"ready": True},
            "generator": {"name": generator.name, "ready": ready, "detail": detail},
            "scorer": engine.grader.scorer.name,
            "thresholds": {"upper": engine.grader.upper, "lower": engine.grader.lower},
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/recent")
    async def recent() -> JSONResponse:
        return JSONResponse({"queries": list(service.recent)})

    @app.get("/queries/{query_id}")
    async def past(query_id: str) -> JSONResponse:
        if query_id not in service.results:
            raise ApiError(404, "not_found", f"no recent query {query_id!r} on this worker")
        return JSONResponse(service.results[query_id])

    @app.post("/query")
    async def query(body: QueryRequest) -> Response:
        text = service.check(body.query)
        started = time.monotonic()
        deadline = started + config.query_timeout_s
        response = await service.run(text, body.explain, body.stream, deadline)
        if not body.stream:
            return JSONResponse(service.record(text, _answer(response), response, started))
        generator_, first = await service.first_token(response, deadline)

        async def events() -> AsyncIterator[Dict[str, Any]]:
            parts: List[str] = []
            try:
                async for token in service.tokens(generator_, first, deadline):
                    parts.append(token)
                    yield {"event": "token", "data": json.dumps({"text": token})}
            except Exception as exc:
                yield {"event": "error", "data": json.dumps(ApiError.mid_stream(exc).body()["error"])}
                return
            yield {"event": "result", "data": json.dumps(service.record(text, "".join(parts), response, started))}

        return EventSourceResponse(events())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> Response:
        text = service.check(_chat_query(body))
        started = time.monotonic()
        deadline = started + config.query_timeout_s
        response = await service.run(text, False, body.stream, deadline)
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        model = config.model_name

        def envelope(kind: str, choice: Dict[str, Any], extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
            return {
                "id": completion_id,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [choice],
                **(extra or {}),
            }

        if not body.stream:
            result = service.record(text, _answer(response), response, started)
            message = {"role": "assistant", "content": result["answer"]}
            return JSONResponse(
                envelope(
                    "chat.completion",
                    {"index": 0, "message": message, "finish_reason": "stop"},
                    {
                        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                        "crag": result["crag"],
                        "sources": result["sources"],
                    },
                )
            )
        generator_, first = await service.first_token(response, deadline)

        async def chunks() -> AsyncIterator[Dict[str, Any]]:
            parts: List[str] = []
            yield {
                "data": json.dumps(
                    envelope(
                        "chat.completion.chunk", {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}
                    )
                )
            }
            try:
                async for token in service.tokens(generator_, first, deadline):
                    parts.append(token)
                    yield {
                        "data": json.dumps(
                            envelope(
                                "chat.completion.chunk",
                                {"index": 0, "delta": {"content": token}, "finish_reason": None},
                            )
                        )
                    }
            except Exception as exc:
                yield {"data": json.dumps(ApiError.mid_stream(exc).body())}
                return
            result = service.record(text, "".join(parts), response, started)
            yield {
                "data": json.dumps(
                    envelope(
                        "chat.completion.chunk",
                        {"index": 0, "delta": {}, "finish_reason": "stop"},
                        {"crag": result["crag"], "sources": result["sources"]},
                    )
                )
            }
            yield {"data": "[DONE]"}

        return EventSourceResponse(chunks())

    app.add_middleware(_BodyLimit, limit=config.max_body_bytes)
    return app
