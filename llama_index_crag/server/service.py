"""What the routes share: the server's settings, and the service that runs queries and remembers the recent ones.

Each query runs on the engine narrowed to its caller's scope (the key's filters, narrowed again by the
request's own), and is remembered for that caller only: ``/recent`` and ``/queries/{id}`` show a caller
its own queries. Callers are told apart by their key's name; a server without keys has one caller.
"""

from __future__ import annotations

import asyncio
import logging
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
from llama_index_crag.errors import GenerationError, InvalidQueryError, RetrievalUnavailableError, ScopeError
from llama_index_crag.scope import Scope
from llama_index_crag.server.errors import ApiError
from llama_index_crag.server.keys import ApiKeys, Caller, KeysFileError
from llama_index_crag.server.metrics import ServerMetrics
from llama_index_crag.server.schemas import QueryResult, RecentQuery, Source
from llama_index_crag.text.cleaning import clean_text, is_blank

#: Characters of a source's text returned as its excerpt.
EXCERPT_CHARS = 600
_END = object()
log = logging.getLogger("llama_index_crag.server")


@dataclass
class ServerConfig:
    """The server's limits and options (the CLI's flags).

    ``api_key`` is one key with no scope (``CRAG_API_KEY``); ``api_keys`` the keys of a keys file, each with its
    caller's name and scope (``keys.load_api_keys``). Neither: the server is open. Both: refused.
    """

    api_key: Optional[str] = None
    api_keys: Optional[ApiKeys] = None
    max_body_bytes: int = 64 * 1024
    query_timeout_s: float = 120.0
    cors_origins: List[str] = field(default_factory=list)
    recent: int = 50
    rate_window_s: float = 300.0
    model_name: str = "llama-index-crag"


def words(text: str) -> int:
    """A count of ``text``'s tokens where no tokenizer is at hand: its words."""
    return len(text.split())


@dataclass
class Generator:
    """The generator as the health check reports it: what it is, a probe saying whether it is ready, a short
    ``label`` for the console's header (default: the name), and how to count its tokens (default: the engine's
    LLM's tokenizer when it has one, else words; see ``token_counter``)."""

    name: str
    probe: Callable[[], Tuple[bool, str]] = lambda: (True, "loaded")
    label: str = ""
    tokens: Optional[Callable[[str], int]] = None

    def __post_init__(self) -> None:
        self.label = self.label or self.name


def token_counter(llm: Any) -> Tuple[Callable[[str], int], str]:
    """How to count tokens of ``llm``'s text, and what that count is: a llama.cpp model in this process counts
    with its own tokenizer; any other generator (Ollama, none) in words, as no tokenizer of it is at hand here."""
    model = getattr(llm, "_model", None)
    tokenize = getattr(model, "tokenize", None)
    if callable(tokenize) and type(model).__module__.startswith("llama_cpp"):

        def count(text: str) -> int:
            return len(tokenize(text.encode("utf-8", "replace"), add_bos=False, special=False)) if text else 0

        return count, "tokens"
    return words, "words"


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
        if config.api_key and config.api_keys is not None:
            raise KeysFileError(
                f"both {config.api_keys.source} and an API key without scope are given: put the unscoped key into "
                "the keys file as an entry without filters"
            )
        #: The server's keys (None: open to anyone, reading everything).
        self.keys: Optional[ApiKeys] = config.api_keys or (ApiKeys.single(config.api_key) if config.api_key else None)
        counted = generator.tokens
        if counted is None:
            counted, _ = token_counter(getattr(engine.synthesizer, "_llm", None))
        #: Counts the tokens of a question or an answer for the chat route's ``usage``.
        self.count_tokens: Callable[[str], int] = counted
        self._variants: Dict[Tuple[bool, bool], CorrectiveQueryEngine] = {}
        #: Each caller's recent queries (newest first) and their whole results, by the key's name.
        self._recent: Dict[Optional[str], Deque[RecentQuery]] = {}
        self._results: Dict[Optional[str], OrderedDict[str, QueryResult]] = {}
        for caller in self.keys.callers if self.keys is not None else ():
            try:  # a key's scope the engine cannot apply is refused now, not at its first query
                self.scoped(caller.scope, stream=False, explain=False)
            except ScopeError as exc:
                raise KeysFileError(f"the filters of the key named {caller.name!r} cannot be used: {exc}") from exc

    def variant(self, stream: bool, explain: bool) -> CorrectiveQueryEngine:
        key = (stream, explain)
        if key not in self._variants:
            self._variants[key] = self.engine.variant(streaming=stream, explain=explain)
        return self._variants[key]

    def scoped(self, scope: Scope, stream: bool, explain: bool) -> CorrectiveQueryEngine:
        """The engine that answers within ``scope`` (the engine keeps its scoped variants; see its ``scoped``)."""
        engine = self.variant(stream, explain)
        return engine.scoped(scope) if scope.bounded else engine

    @staticmethod
    def scope(caller: Caller, filters: Any) -> Scope:
        """The caller's scope narrowed by a request's ``filters`` (never widened), or a 422 naming the field."""
        if filters is None:
            return caller.scope
        try:
            return caller.scope.narrow(filters)
        except ScopeError as exc:
            said = str(exc)
            raise ApiError(422, "invalid_filters", said if said.startswith("filters") else f"filters: {said}") from exc

    def recent(self, caller: Caller) -> List[RecentQuery]:
        """The caller's last queries on this worker, newest first."""
        return list(self._recent.get(caller.name, ()))

    def past(self, caller: Caller, query_id: str) -> Optional[QueryResult]:
        """One of the caller's recent results (None for another caller's, as for an unknown id)."""
        return self._results.get(caller.name, OrderedDict()).get(query_id)

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

    async def run(self, query: str, explain: bool, stream: bool, deadline: float, scope: Scope) -> RESPONSE_TYPE:
        """The engine's response (streaming or not) within ``scope``, or an ``ApiError``."""
        try:
            engine = self.scoped(scope, stream, explain)
            return await asyncio.wait_for(engine.aquery(query), max(0.0, deadline - time.monotonic()))
        except ScopeError as exc:  # filters the index cannot apply: refused, never searched around
            said = str(exc)
            raise ApiError(422, "invalid_filters", said if said.startswith("filters") else f"filters: {said}") from exc
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

    def record(self, caller: Caller, query: str, answer: str, response: RESPONSE_TYPE, started: float) -> QueryResult:
        """The result of an answered query; remembered for the caller's ``/recent``, counted in the metrics (which
        never name the caller) and logged with the caller's name (never its key)."""
        trace = dict(response.metadata["crag"])  # type: ignore[index]
        if caller.name is not None:
            trace["caller"] = caller.name
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
        log.info(
            "query %s by %s: %s%s in %.0f ms",
            result.id,
            caller.name or "anyone",
            result.action,
            ", abstained" if result.abstained else "",
            elapsed,
        )
        recent = self._recent.setdefault(caller.name, deque(maxlen=self.config.recent))
        results = self._results.setdefault(caller.name, OrderedDict())
        recent.appendleft(
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
        results[result.id] = result
        while len(results) > self.config.recent:
            results.popitem(last=False)
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
