"""The opt-in web-search fallback: providers, the privacy guard, the URL policy and the retriever."""

from llama_index_crag.web.pages import UrlPolicy, extract_main_text
from llama_index_crag.web.privacy import scrub_query
from llama_index_crag.web.providers import (
    DuckDuckGoSearch,
    SearchProvider,
    SearchResult,
    SearxNGSearch,
    TavilySearch,
    WebSearchError,
)
from llama_index_crag.web.retriever import ORIGIN_KEY, WebReport, WebSearchRetriever, collect_web_reports, is_web

__all__ = [
    "ORIGIN_KEY",
    "DuckDuckGoSearch",
    "SearchProvider",
    "SearchResult",
    "SearxNGSearch",
    "TavilySearch",
    "UrlPolicy",
    "WebReport",
    "WebSearchError",
    "WebSearchRetriever",
    "collect_web_reports",
    "extract_main_text",
    "is_web",
    "scrub_query",
]
