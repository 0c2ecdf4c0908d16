"""Search providers: a self-hosted SearxNG (its JSON API), Tavily and DuckDuckGo, through their maintained clients."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Protocol, Sequence

import httpx

from llama_index_crag.errors import ConfigError, MissingDependency, WebSearchError
from llama_index_crag.web.settings import WebSearchSettings

_INSTALL = "pip install 'llama-index-crag[web]'"
#: The largest search answer read (a SearxNG page of results is tens of kilobytes).
MAX_ANSWER_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class SearchResult:
    """One search result: the page to fetch, and what the provider says about it."""

    url: str
    title: str = ""
    snippet: str = ""


class SearchProvider(Protocol):
    """Turns a (scrubbed) keyword query into result URLs. Only ``query`` leaves the machine."""

    name: str

    def search(self, query: str, max_results: int, timeout_s: float) -> List[SearchResult]:
        """Ask the provider; raise ``WebSearchError`` on any failure."""
        ...


def without_credentials(text: str) -> str:
    """``text`` with the user and password of every URL in it masked (``http://admin:***@host``)."""
    return re.sub(r"(?<=://)[^/\s@]+@", "***@", text)


class SearxNGSearch:
    """A SearxNG instance through its documented JSON API (``/search?q=...&format=json``).

    SearxNG has no maintained Python client, so this uses httpx on the JSON API; the
    instance must list ``json`` under ``search.formats`` in its ``settings.yml``.
    """

    name = "searxng"

    def __init__(self, base_url: str, user_agent: str = "llama-index-crag web fallback") -> None:
        self.base_url = base_url.rstrip("/")
        self.user_agent = user_agent

    def search(self, query: str, max_results: int, timeout_s: float) -> List[SearchResult]:
        # httpx's timeout bounds each read, not the call: a server that drips its answer a byte a second would hold
        # the search for as long as it pleases. So the body is read here, against a deadline for the whole call.
        deadline = time.monotonic() + timeout_s
        where = without_credentials(self.base_url)  # the errors end in traces and abstention reasons
        late = WebSearchError(f"SearxNG at {where} did not answer within {timeout_s:g} s")
        try:
            with httpx.stream(
                "GET",
                f"{self.base_url}/search",
                params={"q": query, "format": "json"},
                headers={"User-Agent": self.user_agent, "Accept": "application/json"},
                timeout=timeout_s,
                follow_redirects=False,
            ) as response:
                response.raise_for_status()
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if time.monotonic() > deadline:
                        raise late
                    if len(body) > MAX_ANSWER_BYTES:
                        raise WebSearchError(f"SearxNG at {where} answered over {MAX_ANSWER_BYTES:,} bytes")
            data = json.loads(body)
        except httpx.TimeoutException as exc:
            raise late from exc
        except (httpx.HTTPError, httpx.InvalidURL, ValueError, RecursionError) as exc:  # Recursion: JSON nested deep
            raise WebSearchError(
                f"SearxNG at {where} failed: {type(exc).__name__}: {without_credentials(str(exc))} "
                "(is the instance up, and is 'json' in its search.formats?)"
            ) from exc
        results = data.get("results", []) if isinstance(data, dict) else None
        if not isinstance(results, list):
            raise WebSearchError(f"SearxNG at {where} answered JSON without a 'results' list")
        return _results(results, "url", "content", max_results)


class TavilySearch:
    """Tavily through its maintained client (``tavily-python``); ``api_base_url`` points it at another host."""

    name = "tavily"

    def __init__(
        self,
        api_key: Optional[str] = None,
        base_url: Optional[str] = None,
        include_domains: Sequence[str] = (),
        exclude_domains: Sequence[str] = (),
    ) -> None:
        try:
            from tavily import TavilyClient
        except ImportError as exc:
            raise MissingDependency(f"the Tavily provider needs tavily-python: {_INSTALL}") from exc
        try:
            self._client = TavilyClient(api_key=api_key, api_base_url=base_url)
        except Exception as exc:
            raise ConfigError(
                f"Tavily is not configured ({exc}): set CRAG_WEB_TAVILY_API_KEY or TAVILY_API_KEY"
            ) from exc
        self._include = [d.removeprefix("*.") for d in include_domains]
        self._exclude = [d.removeprefix("*.") for d in exclude_domains]

    def search(self, query: str, max_results: int, timeout_s: float) -> List[SearchResult]:
        try:
            data = self._client.search(
                query,
                max_results=max_results,
                search_depth="basic",
                include_domains=self._include or None,
                exclude_domains=self._exclude or None,
                timeout=timeout_s,
            )
        except Exception as exc:
            raise WebSearchError(f"Tavily search failed: {type(exc).__name__}: {exc}") from exc
        return _results(data.get("results", []), "url", "content", max_results)


class DuckDuckGoSearch:
    """DuckDuckGo through ``ddgs`` (the maintained successor of ``duckduckgo-search``), DuckDuckGo only."""

    name = "duckduckgo"

    def __init__(self, region: str = "wt-wt") -> None:
        try:
            import ddgs  # noqa: F401
        except ImportError as exc:
            raise MissingDependency(f"the DuckDuckGo provider needs ddgs: {_INSTALL}") from exc
        self.region = region

    def search(self, query: str, max_results: int, timeout_s: float) -> List[SearchResult]:
        from ddgs import DDGS

        try:
            found = DDGS(timeout=max(1, int(timeout_s))).text(
                query, region=self.region, max_results=max_results, backend="duckduckgo"
            )
        except Exception as exc:
            raise WebSearchError(f"DuckDuckGo search failed: {type(exc).__name__}: {exc}") from exc
        return _results(found, "href", "body", max_results)


def _results(items: Sequence[Mapping[str, Any]], url_key: str, snippet_key: str, limit: int) -> List[SearchResult]:
    results = []
    for item in items:
        if not isinstance(item, Mapping):  # a provider's odd item is skipped, not the whole search
            continue
        url = item.get(url_key)
        if isinstance(url, str) and url:
            results.append(
                SearchResult(url=url, title=str(item.get("title") or ""), snippet=str(item.get(snippet_key) or ""))
            )
    return results[:limit]


def provider_from_settings(settings: WebSearchSettings) -> SearchProvider:
    """The provider the settings name, configured, or an error that says what is missing."""
    if settings.provider == "searxng":
        if not settings.searxng_url:
            raise ConfigError("the SearxNG provider needs its address: set CRAG_WEB_SEARXNG_URL or searxng_url=")
        return SearxNGSearch(settings.searxng_url, settings.user_agent)
    if settings.provider == "tavily":
        return TavilySearch(settings.tavily_api_key, settings.tavily_url, settings.allow_domains, settings.deny_domains)
    return DuckDuckGoSearch(settings.duckduckgo_region)
