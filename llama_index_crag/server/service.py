"""What the routes share: the server's settings, and the service that runs queries and remembers the recent ones."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict, deque
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncGenerator, AsyncIterator, Callable, Deque, Dict, List, Optional, Tuple

from fastapi import Depends, Request
from llama_index.core.base.response.schema import RESPONSE_TYPE, AsyncStreamingResponse, StreamingResponse
from llama_index.core.schema import NodeWithScore
from starlette.concurrency import iterate_in_threadpool

from llama_index_crag.core.engine import CorrectiveQueryEngine
from llama_index_crag.core.fallback import SOURCE_KEY
from llama_index_crag.errors import GenerationError, InvalidQueryError, RetrievalUnavailableError
from llama_index_crag.server.errors import ApiError
from llama_index_crag.server.metrics import ServerMetrics
from llama_index_crag.server.schemas import QueryResult, RecentQuery, Source
from llama_index_crag.text.cleaning import clean_text, is_blank

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


@dataclass
class Generator:
    """The generator as the health check reports it: a name and a probe saying whether it is ready."""

    name: str
    probe: Callable[[], Tuple[bool, str]] = lambda: (True, "loaded")


class QueryService:
    """Runs queries through the engine (variants for streaming and explanations) and keeps the recent ones.

    Every call awaits the engine's async path (``aquery``) under what is left of the query's
    budget (``asyncio.wait_for``): past it the query is cancelled and answered 504.
    """

    def __init__(
        self,
        engine: CorrectiveQueryEngine,
        config: ServerConfig,
        metrics: ServerMetrics,
        generator: Generator,
        index_info: Optional[Dict[str, Any]] = None,
    ) -> None:
        self.engine, self.config, self.metrics, self.generator = engine, config, metrics, generator
        #: What ``/healthz`` says of the loaded index.
        self.index_info = index_info
        self._variants: Dict[Tuple[bool, bool], CorrectiveQueryEngine] = {}
        self.recent: Deque[RecentQuery] = deque(maxlen=config.recent)
        self.results: OrderedDict[str, QueryResult] = OrderedDict()

    def variant(self, stream: bool, explain: bool) -> CorrectiveQueryEngine:
        key = (stream, explain)
        if key not in self._variants:
            self._variants[key] = self.engine.variant(streaming=stream, explain=explain)
        return self._variants[key]

    def check(self, query: Any, where: str = "the 'query' field") -> str:
        """The query as the engine takes it (``clean_text``), or a 400 that says what is wrong and where."""
        if isinstance(query, str):
            query = clean_text(query)
        if not isinstance(query, str) or is_blank(query):
            raise ApiError(400, "empty_query", f"the query is empty: send a question in {where}")
        # The engine's own limit (one value for both): checked here too, to refuse before the engine is asked.
        limit = self.engine.settings.max_query_chars
        if len(query) > limit:
            raise ApiError(
                400, "query_too_long", f"the query is {len(query):,} characters, over the limit of {limit:,}"
            )
        return query

    def deadline(self) -> float:
        """When a query that starts now runs out of its budget (``time.monotonic()`` seconds)."""
        return time.monotonic() + self.config.query_timeout_s

    async def run(self, query: str, explain: bool, stream: bool, deadline: float) -> RESPONSE_TYPE:
        """The engine's response (streaming or not), or an ``ApiError``."""
        engine = self.variant(stream, explain)
        try:
            return await asyncio.wait_for(engine.aquery(query), max(0.0, deadline - time.monotonic()))
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

    async def first_token(self, response: RESPONSE_TYPE, deadline: float) -> Tuple[AsyncGenerator[str, None], Any]:
        """Pull the first token of a streaming response here, so that a dead generator still gets its 503."""
        tokens = _tokens(response)
        try:
            first = await asyncio.wait_for(anext(tokens, _END), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            await tokens.aclose()
            raise self._timeout() from None
        except Exception as exc:
            named = isinstance(exc, GenerationError)  # it names the model already
            said = str(exc) if named else f"the generator failed: {type(exc).__name__}: {exc}"
            raise ApiError(503, "generator_unavailable", said, "server_error") from exc
        return tokens, first

    async def tokens(self, tokens: AsyncGenerator[str, None], first: Any, deadline: float) -> AsyncIterator[str]:
        """The rest of the answer's tokens, each awaited under what is left of the budget."""
        token = first
        try:
            while token is not _END:
                yield str(token)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timeout()
                try:
                    token = await asyncio.wait_for(anext(tokens, _END), left)
                except asyncio.TimeoutError:
                    raise self._timeout() from None
        finally:
            await tokens.aclose()

    def record(self, query: str, answer: str, response: RESPONSE_TYPE, started: float) -> QueryResult:
        """The result of an answered query; remembered for ``/recent`` and counted in the metrics."""
        trace = dict(response.metadata["crag"])  # type: ignore[index]
        elapsed = round((time.monotonic() - started) * 1000.0, 1)
        result = QueryResult(
            id=f"q-{uuid.uuid4().hex[:12]}",
            created=int(time.time()),
            query=query,
            answer=answer,
            abstained=trace["abstained"],
            action=trace["action"],
            answered_by=trace.get("answered_by"),
            grounded=trace.get("grounded"),
            sources=[_source(n, trace) for n in response.source_nodes or []],
            elapsed_ms=elapsed,
            crag=trace,
        )
        self.metrics.observe(trace, elapsed / 1000.0)
        self.recent.appendleft(
            RecentQuery(
                id=result.id,
                created=result.created,
                query=query,
                action=result.action,
                abstained=result.abstained,
                elapsed_ms=elapsed,
                top_score=trace.get("top_score"),
            )
        )
        self.results[result.id] = result
        while len(self.results) > self.config.recent:
            self.results.popitem(last=False)
        return result


def query_service(request: Request) -> QueryService:
    """The app's service (``app.state.service``), for the routes to depend on."""
    service: QueryService = request.app.state.service
    return service


#: A route's parameter that receives the app's service.
Service = Annotated[QueryService, Depends(query_service)]


def answer_text(response: RESPONSE_TYPE) -> str:
    """The generated text ("" when nothing generates: grading-only serving)."""
    return "" if getattr(response, "response", None) is None else str(response.response)  # type: ignore[union-attr]


async def _tokens(response: RESPONSE_TYPE) -> AsyncGenerator[str, None]:
    """The tokens of a streaming response."""
    if isinstance(response, AsyncStreamingResponse):
        async with aclosing(response.response_gen) as tokens:  # closed when the reader stops: the LLM's stream ends
            async for token in tokens:
                yield token
    elif isinstance(response, StreamingResponse) and response.response_gen is not None:
        # A synthesizer that streams through a plain generator even on the async path: each next() may block
        # on the model, so it is pulled in the thread pool rather than on the event loop.
        async for token in iterate_in_threadpool(response.response_gen):
            yield token
    else:  # a synthesizer that does not stream: its answer in one piece
        yield answer_text(response)


def _source(node: NodeWithScore, trace: Dict[str, Any]) -> Source:
    inner = node.node
    origin = inner.metadata.get(SOURCE_KEY) or "primary"
    original = inner.node_id.split("#strips")[0]
    graded = [g for g in trace.get("nodes", []) if g["node_id"] in (inner.node_id, original)]
    text = inner.get_content()
    return Source(
        id=inner.node_id,
        doc_id=inner.metadata.get("doc_id") or inner.ref_doc_id,
        excerpt=text[:EXCERPT_CHARS] + ("…" if len(text) > EXCERPT_CHARS else ""),
        score=None if node.score is None else round(float(node.score), 4),
        label=graded[-1]["label"] if graded else None,
        origin="primary" if origin == "retriever" else origin,
        refined=inner.node_id.endswith("#strips"),
        url=inner.metadata.get("url"),
    )
