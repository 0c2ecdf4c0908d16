"""WebSearchRetriever: the opt-in web source of the fallback chain, and the report of what it sent and fetched."""

from __future__ import annotations

import asyncio
import hashlib
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.text.strips import decompose
from llama_index_crag.web.pages import Page, UrlPolicy, fetch_pages
from llama_index_crag.web.privacy import scrub_query
from llama_index_crag.web.providers import SearchProvider, WebSearchError, provider_from_settings
from llama_index_crag.web.settings import WebSearchSettings

#: Node metadata that marks a passage as coming from the web (hidden from the LLM and the embedder).
ORIGIN_KEY = "crag_origin"
WEB = "web"
#: Metadata of a web strip that refers back: the subject it was graded with ("The Orrin Lighthouse").
SUBJECT_KEY = "subject"


@dataclass
class WebReport:
    """One web search as the trace shows it: exactly what was sent, what was fetched, what was refused."""

    provider: str
    #: The string the search provider received; None when nothing was sent.
    sent_query: Optional[str] = None
    forbidden: bool = False
    skipped: Optional[str] = None
    results: int = 0
    urls_fetched: List[str] = field(default_factory=list)
    urls_used: List[str] = field(default_factory=list)
    refused: List[Dict[str, str]] = field(default_factory=list)
    bytes_read: int = 0
    strips: int = 0
    error: Optional[str] = None
    elapsed_ms: float = 0.0

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON-ready data."""
        return asdict(self)


_REPORTS: ContextVar[Optional[List[WebReport]]] = ContextVar("crag_web_reports", default=None)


@contextmanager
def collect_web_reports() -> Iterator[List[WebReport]]:
    """Collect the reports of every web search made inside the block (in this context, its threads and tasks)."""
    reports: List[WebReport] = []
    token = _REPORTS.set(reports)
    try:
        yield reports
    finally:
        _REPORTS.reset(token)


class WebSearchRetriever(BaseRetriever):
    """Searches the web for the fallback path and returns graded-ready strips of the result pages.

    In order: the kill switch (``forbidden``: nothing is sent); the privacy guard (the
    query minus e-mail addresses, phone numbers and ``redact_patterns`` is all that
    goes to the provider); the search; the URL policy on every result before anything
    is fetched; budgeted, concurrent fetching; main-text extraction without scripts,
    styles or hidden text; and strips (``decompose``, as the refiner splits). With a
    ``scorer`` the strips are ranked with it and the best ``max_strips`` kept; the
    engine grades them against the user's question like any other candidate.

    Each strip's metadata has ``url`` and ``title`` of its page and ``crag_origin="web"``.
    A search that fails or times out raises ``WebSearchError`` (the engine abstains);
    single pages that fail are refused and reported. ``collect_web_reports`` hands the
    caller a ``WebReport`` of each search.

    Args:
        settings: Provider, lists, budgets and privacy (``WebSearchSettings.resolve()``).
        provider: A ready provider; default: the one the settings name.
        scorer: Ranks strips before the ``max_strips`` cut; default: page order.
        strip_min_tokens: Shortest strip, in words (as the refiner).
    """

    embeds_queries = False  #: the provider is sent the rewrite's words, never a vector

    def __init__(
        self,
        settings: Optional[WebSearchSettings] = None,
        provider: Optional[SearchProvider] = None,
        scorer: Optional[RelevanceScorer] = None,
        strip_min_tokens: int = 8,
        callback_manager: Optional[CallbackManager] = None,
    ) -> None:
        self.settings = settings or WebSearchSettings.resolve()
        self._provider = provider
        self._scorer = scorer
        self._strip_min_tokens = strip_min_tokens
        self._policy = UrlPolicy(
            self.settings.allow_domains, self.settings.deny_domains, self.settings.allow_private_addresses
        )
        if not self.settings.forbidden and provider is None:
            self._provider = provider_from_settings(self.settings)
        super().__init__(callback_manager=callback_manager)

    @classmethod
    def class_name(cls) -> str:
        return "WebSearchRetriever"

    @property
    def provider_name(self) -> str:
        """The provider's name, as the trace records it."""
        return self._provider.name if self._provider is not None else self.settings.provider

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        s = self.settings
        report = WebReport(provider=self.provider_name)
        reports = _REPORTS.get()
        if reports is not None:
            reports.append(report)
        start = time.monotonic()
        deadline = start + s.deadline_s
        try:
            return self._search(query_bundle, report, deadline)
        finally:
            report.elapsed_ms = round((time.monotonic() - start) * 1000.0, 3)

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)

    def _search(self, query_bundle: QueryBundle, report: WebReport, deadline: float) -> List[NodeWithScore]:
        s = self.settings
        if s.forbidden or self._provider is None:
            report.forbidden = True
            report.skipped = "web search is forbidden (CRAG_WEB_FORBIDDEN): nothing was sent"
            return []
        query = scrub_query(query_bundle.query_str, s.redact_patterns)
        if not query:
            report.skipped = "nothing of the query was left to send after the privacy guard"
            return []
        report.sent_query = query
        try:
            results = self._provider.search(query, s.max_results, min(s.timeout_s, s.deadline_s))
        except WebSearchError as exc:
            report.error = str(exc)
            raise
        report.results = len(results)
        allowed: List[str] = []
        for result in results:
            reason = self._policy.check(result.url)
            if reason:
                report.refused.append({"url": result.url, "reason": reason})
            elif result.url not in allowed:
                allowed.append(result.url)
        if time.monotonic() >= deadline:
            report.error = f"the web search ran past its {s.deadline_s:g} s budget"
            raise WebSearchError(report.error)
        pages, refusals, requested = fetch_pages(allowed, s, self._policy, deadline)
        report.urls_fetched = requested
        report.urls_used = [p.url for p in pages]
        report.refused.extend({"url": r.url, "reason": r.reason} for r in refusals)
        report.bytes_read = sum(p.bytes_read for p in pages)
        strips = self._strips(query, pages)
        report.strips = len(strips)
        return strips

    def _strips(self, query: str, pages: List[Page]) -> List[NodeWithScore]:
        nodes: List[TextNode] = []
        graded: List[str] = []
        for page in pages:
            digest = hashlib.sha1(page.url.encode("utf-8")).hexdigest()[:12]
            for i, strip in enumerate(decompose(page.text, self._strip_min_tokens, page.title)):
                graded.append(strip.graded_text)
                hidden = ["url", "title", ORIGIN_KEY]
                # A strip that refers back ("It rises 41 metres ...") keeps the subject it was graded with, so that
                # grading it again (the fallback's regrade) reads it as this retriever did; the generator sees none.
                subject = {SUBJECT_KEY: strip.context} if strip.context else {}
                nodes.append(
                    TextNode(
                        id_=f"web-{digest}-{i}",
                        text=strip.text,
                        metadata={"url": page.url, "title": page.title, ORIGIN_KEY: WEB, **subject},
                        excluded_llm_metadata_keys=[*hidden, SUBJECT_KEY],
                        excluded_embed_metadata_keys=list(hidden),
                    )
                )
        if self._scorer is None or not nodes:
            return [NodeWithScore(node=n, score=None) for n in nodes[: self.settings.max_strips]]
        scores = self._scorer.score_texts(query, graded)
        ranked = sorted(zip(nodes, scores), key=lambda pair: -pair[1])[: self.settings.max_strips]
        return [NodeWithScore(node=n, score=float(score)) for n, score in ranked]


def is_web(node: Any) -> bool:
    """Whether a node (or NodeWithScore) came from the web."""
    node = getattr(node, "node", node)
    return bool(getattr(node, "metadata", {}).get(ORIGIN_KEY) == WEB)
