"""The query server's ASGI app: ``create_app(engine, ...)`` wraps any ``CorrectiveQueryEngine``.

``llama-crag serve`` builds one over a persisted index folder (``llama-crag ingest``). Routes
(``routes/``): ``POST /query`` (JSON, or server-sent events with ``"stream": true``),
``POST /v1/chat/completions`` (OpenAI's chat format), ``GET /metrics`` (Prometheus),
``GET /healthz``, ``GET /recent`` and ``GET /queries/{id}`` (the last answers, for the
console), ``GET /`` (the console).

Safe by default: the CLI binds to 127.0.0.1; ``CRAG_API_KEY`` (or ``api_key=``) or a keys
file (``--api-keys``, or ``api_keys=``: each key with its caller's name and scope) guards
every data route (``Authorization: Bearer KEY`` or ``X-API-Key``) but ``/healthz`` and the
console's static page, which holds no data and asks for the key. A key's queries are
answered within its scope (``engine.scoped``), and each caller sees only its own recent
queries. Bodies and queries have
size limits; CORS is off unless origins are given. Every error is JSON in OpenAI's shape,
``{"error": {"type", "code", "message"}}``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from llama_index_crag.errors import MissingDependency
from llama_index_crag.server import INSTALL

try:
    from fastapi import FastAPI
except ImportError as exc:  # the optional [server] extra
    raise MissingDependency(f"the query server needs FastAPI: {INSTALL}") from exc

from llama_index_crag.core.engine import CorrectiveQueryEngine
from llama_index_crag.server.auth import unauthorized
from llama_index_crag.server.errors import add_error_handlers
from llama_index_crag.server.metrics import ServerMetrics, install_engine_metrics
from llama_index_crag.server.middleware import BodyLimit, RequestMetrics
from llama_index_crag.server.routes import admin, openai, query
from llama_index_crag.server.service import Generator, QueryService, ServerConfig


def create_app(
    engine: CorrectiveQueryEngine,
    config: Optional[ServerConfig] = None,
    generator: Optional[Generator] = None,
    index_info: Optional[Dict[str, Any]] = None,
) -> FastAPI:
    """The ASGI app around ``engine``.

    Args:
        engine: The engine that answers; the app makes its streaming and explaining variants.
        config: Limits and options (the CLI's flags); defaults to ``ServerConfig()``.
        generator: What generates and how to probe it, for ``/healthz``; defaults to the engine's LLM, always ready.
        index_info: What ``/healthz`` says of the loaded index.
    """
    config = config or ServerConfig()
    generator = generator or Generator(name=type(getattr(engine.synthesizer, "_llm", None)).__name__)
    install_engine_metrics()
    metrics = ServerMetrics(config.rate_window_s)
    app = FastAPI(title="llama-index-crag", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = QueryService(engine, config, metrics, generator, index_info)
    add_error_handlers(app, unauthorized)
    for router in (query.router, openai.router, admin.public, admin.guarded):
        app.include_router(router)
    app.mount("/static", admin.ConsoleFiles(directory=admin.STATIC), name="static")
    # The last added is the outermost. The body limit reads the body before the app does, inside the metrics
    # (a 413 is counted like any other status) and inside CORS (a browser can read the 413).
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=metrics)
    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-API-Key"],
        )
    return app
