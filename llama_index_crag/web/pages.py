"""Result pages: the URL policy applied before any fetch, budgeted fetching, decoding and main-text extraction."""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union
from urllib.parse import urljoin, urlsplit

import httpx

from llama_index_crag.errors import ConfigError, MissingDependency
from llama_index_crag.web.settings import WebSearchSettings

TEXT_TYPES = ("text/html", "application/xhtml+xml", "text/plain")
MAX_REDIRECTS = 3
_HIDDEN_STYLE = re.compile(
    r"display\s*:\s*none|visibility\s*:\s*hidden|font-size\s*:\s*0+(?:px|pt|em|rem|%)?\s*(?:;|$)", re.I
)
_HIDDEN_CLASSES = {"hidden", "d-none", "sr-only", "visually-hidden", "invisible"}
_DROPPED_TAGS = [
    "script",
    "style",
    "noscript",
    "template",
    "iframe",
    "object",
    "embed",
    "svg",
    "canvas",
    "link",
    "meta",
]


@dataclass(frozen=True)
class Page:
    """A fetched result page reduced to its main text."""

    url: str
    title: str
    text: str
    bytes_read: int


@dataclass(frozen=True)
class Refusal:
    """A result page that was not used, and why (off the allowlist, too big, binary, timed out ...)."""

    url: str
    reason: str


class UrlPolicy:
    """Which URLs may be fetched: http(s) only, the allow and deny lists, and no private addresses.

    A list entry ``example.org`` (or ``*.example.org``) matches that host and every
    subdomain of it; the deny list wins. ``check`` needs no network and runs on every
    result before anything is fetched; ``check_address`` resolves the host and refuses
    loopback, private, link-local and reserved addresses unless they are allowed.
    """

    def __init__(self, allow: Sequence[str] = (), deny: Sequence[str] = (), allow_private: bool = False) -> None:
        self.allow = [_domain(d) for d in allow if d.strip()]
        self.deny = [_domain(d) for d in deny if d.strip()]
        self.allow_private = allow_private

    def check(self, url: str) -> Optional[str]:
        """Why ``url`` must not be fetched, or None."""
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018  (reading it is what tells a bad port: "host:443x")
        except ValueError as exc:
            return f"not a valid URL ({exc})"
        if parts.scheme not in ("http", "https"):
            return f"scheme {parts.scheme or '(none)'!r} is not http(s)"
        if "@" in parts.netloc:  # httpx would send them as Basic auth, and the trace would show them
            return "the URL carries a user name or password"
        try:
            host = wire_host(url)
        except (httpx.InvalidURL, UnicodeError) as exc:
            return f"not a valid URL ({exc})"
        if not host:
            return "the URL has no host"
        if any(_matches(host, d) for d in self.deny):
            return f"{host} is on the deny list"
        if self.allow and not any(_matches(host, d) for d in self.allow):
            return f"{host} is not on the allow list"
        return None

    def check_address(self, url: str) -> Optional[str]:
        """Why the host of ``url`` resolves somewhere it must not go, or None."""
        if self.allow_private:
            return None
        try:
            host = wire_host(url)  # the host httpx will connect to, not another spelling of it
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except (httpx.InvalidURL, UnicodeError) as exc:
            return f"not a valid URL ({exc})"
        except OSError as exc:
            return f"cannot resolve {host}: {exc}"
        for info in infos:
            address = ipaddress.ip_address(info[4][0])
            if not address.is_global:
                return f"{host} resolves to a non-public address ({address}); set allow_private_addresses to allow it"
        return None


def _domain(entry: str) -> str:
    """A list entry as a host is compared with it: lower case, in its ASCII (IDNA) spelling, so that
    "bücher.de" and "xn--bcher-kva.de" are one entry. Anything but a domain (a URL, a port) is refused: it
    would never match, and a deny list that matches nothing fails open."""
    domain = entry.strip().lower().removeprefix("*.").rstrip(".")
    if not re.fullmatch(r"[^\s/:@?#\[\]]+", domain):
        raise ConfigError(
            f"{entry!r} is not a domain for the web allow or deny list: write example.org or *.example.org"
        )
    try:
        return wire_host(f"http://{domain}/")
    except (httpx.InvalidURL, UnicodeError) as exc:
        raise ConfigError(f"{entry!r} is not a domain for the web allow or deny list ({exc})") from exc


def wire_host(url: str) -> str:
    """The host of ``url`` as httpx sends it and connects to it: lower case, in its ASCII spelling (IDNA 2008,
    as httpx encodes it: "straße.de" is xn--strae-oqa.de, not the strasse.de of Python's IDNA 2003 codec,
    which would let a list entry or the address check speak of another domain than the one fetched)."""
    return httpx.URL(url).raw_host.decode("ascii").lower().rstrip(".")


def _matches(host: str, domain: str) -> bool:
    return host == domain or host.endswith("." + domain)


class _ByteBudget:
    """The bytes all pages of one query may still read, shared by the fetching threads."""

    def __init__(self, total: int) -> None:
        self.left = total
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            self.left -= n
            return self.left >= 0


def fetch_pages(
    urls: Sequence[str], settings: WebSearchSettings, policy: UrlPolicy, deadline: float
) -> Tuple[List[Page], List[Refusal], List[str]]:
    """Fetch ``urls`` concurrently within the budgets: (pages used, pages refused, URLs requested).

    Each call has ``timeout_s``; the whole batch stops at ``deadline`` (monotonic),
    and pages still loading then are refused. Redirects are followed by hand, at most
    ``MAX_REDIRECTS``, each hop checked against the policy before it is requested.
    """
    budget = _ByteBudget(settings.max_total_bytes)
    requested: List[str] = []
    headers = {
        "User-Agent": settings.user_agent,
        "Accept": "text/html, application/xhtml+xml, text/plain;q=0.8",
        "Accept-Encoding": "gzip, deflate",  # the encodings _Inflater reads
    }
    client = httpx.Client(headers=headers, follow_redirects=False)
    pool = ThreadPoolExecutor(max_workers=min(settings.concurrency, max(1, len(urls))), thread_name_prefix="crag-web")
    futures = {pool.submit(_fetch, client, url, settings, policy, deadline, budget, requested): url for url in urls}
    done, _ = wait(futures, timeout=max(0.0, deadline - time.monotonic()))
    pool.shutdown(wait=False, cancel_futures=True)
    pages: List[Page] = []
    refused: List[Refusal] = []
    for future, url in futures.items():
        outcome = future.result() if future in done else Refusal(url, "still loading when the web time budget ran out")
        (pages if isinstance(outcome, Page) else refused).append(outcome)  # type: ignore[arg-type]
    if all(f in done for f in futures):
        client.close()
    return pages, refused, list(requested)


def _fetch(
    client: httpx.Client,
    url: str,
    settings: WebSearchSettings,
    policy: UrlPolicy,
    deadline: float,
    budget: _ByteBudget,
    requested: List[str],
) -> Union[Page, Refusal]:
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        reason = policy.check(current) or policy.check_address(current)
        if reason:
            return Refusal(current, reason)
        timeout = min(settings.timeout_s, deadline - time.monotonic())
        if timeout <= 0:
            return Refusal(url, "the web time budget ran out before it was fetched")
        requested.append(current)
        try:
            with client.stream("GET", current, timeout=timeout) as response:
                if response.is_redirect and "location" in response.headers:
                    current = urljoin(current, response.headers["location"])
                    continue
                if response.status_code != 200:
                    return Refusal(url, f"HTTP {response.status_code}")
                content_type = response.headers.get("content-type", "")
                mime = content_type.split(";")[0].strip().lower()
                if mime and mime not in TEXT_TYPES:
                    return Refusal(url, f"not a text page ({mime})")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > settings.max_page_bytes:
                    return Refusal(
                        url, f"declares {int(declared):,} bytes, over the {settings.max_page_bytes:,}-byte page limit"
                    )
                encoding = response.headers.get("content-encoding", "")
                inflater = _Inflater.for_encoding(encoding)
                if inflater is None:
                    return Refusal(url, f"compressed as {encoding!r}, which is not read")
                body = bytearray()
                for raw in response.iter_raw():
                    chunk = inflater.inflate(raw, settings.max_page_bytes - len(body) + 1)
                    body += chunk
                    if len(body) > settings.max_page_bytes:
                        return Refusal(url, f"over the {settings.max_page_bytes:,}-byte page limit (stopped reading)")
                    if not budget.take(len(chunk)):
                        return Refusal(url, f"over the {settings.max_total_bytes:,}-byte total limit (stopped reading)")
                    if time.monotonic() > deadline:
                        return Refusal(url, "the web time budget ran out while reading it")
                body += inflater.flush()
        except zlib.error as exc:
            return Refusal(url, f"not valid {encoding} content: {exc}")
        except httpx.TimeoutException:
            return Refusal(url, f"no answer within {timeout:.3g} s")
        except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL: a redirect's bad Location, not an HTTPError
            return Refusal(url, f"{type(exc).__name__}: {exc}")
        try:
            return _page(url, bytes(body), content_type, mime)
        except Exception as exc:  # a hostile page may break the parser ("<![foo[ x ]]>"): it alone is refused
            return Refusal(url, f"the page could not be parsed: {type(exc).__name__}: {exc}")
    return Refusal(url, f"more than {MAX_REDIRECTS} redirects")


class _Inflater:
    """A page's Content-Encoding undone a network chunk at a time, never to more than the room left.

    httpx decodes each chunk whole before handing it over, so a gzip bomb (a few
    kilobytes that inflate to gigabytes) would take hundreds of megabytes before the
    page limit could refuse it; ``inflate`` stops at ``room`` bytes instead.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._zlib = None if kind == "identity" else zlib.decompressobj(16 + zlib.MAX_WBITS if kind == "gzip" else 15)
        self._first = True

    @classmethod
    def for_encoding(cls, header: str) -> Optional[_Inflater]:
        """The inflater for a Content-Encoding header, or None for an encoding (or a chain) that is not read."""
        codings = [c.strip().lower() for c in header.split(",") if c.strip() and c.strip().lower() != "identity"]
        if not codings:
            return cls("identity")
        if len(codings) == 1 and codings[0] in ("gzip", "x-gzip", "deflate"):
            return cls("deflate" if codings[0] == "deflate" else "gzip")
        return None

    def inflate(self, data: bytes, room: int) -> bytes:
        """At most ``room`` bytes of ``data`` decoded; what does not fit is dropped, as the page is then refused."""
        if self._zlib is None:
            return data
        first, self._first = self._first, False
        try:
            return self._zlib.decompress(data, max(1, room))
        except zlib.error:
            if not (first and self.kind == "deflate"):
                raise
            self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)  # "deflate" is often sent without its zlib header
            return self._zlib.decompress(data, max(1, room))

    def flush(self) -> bytes:
        return b"" if self._zlib is None else self._zlib.flush()


def _page(url: str, body: bytes, content_type: str, mime: str) -> Union[Page, Refusal]:
    text = decode(body, content_type)
    if text is None:
        return Refusal(url, "binary or undecodable content")
    title, main = ("", text.strip()) if mime == "text/plain" else extract_main_text(text)
    if not main:
        return Refusal(url, "no main text found")
    return Page(url=url, title=title, text=main, bytes_read=len(body))


def decode(body: bytes, content_type: str = "") -> Optional[str]:
    """The body as text, or None for binary or undecodable bodies (NUL bytes, many control characters).

    As the HTML standard orders it: the charset the header declares, then the page's
    own declaration, then detection (charset-normalizer), where windows-1252, the
    web's legacy default, wins when it is among the candidates (detection alone
    guesses short Western pages wrong).
    """
    header = re.search(r"charset=[\"']?([\w.:-]+)", content_type, re.I)
    if header:  # first, and before the NUL test: UTF-16 text is full of NUL bytes
        try:
            return _text_or_none(body.decode(header.group(1)))
        except (LookupError, UnicodeDecodeError):
            pass
    if b"\x00" in body[:8192]:
        return None
    from bs4.dammit import EncodingDetector
    from charset_normalizer import from_bytes

    page_declared = EncodingDetector.find_declared_encoding(body, is_html=True)
    if page_declared:
        try:
            return _text_or_none(body.decode(page_declared))
        except (LookupError, UnicodeDecodeError):
            pass
    matches = from_bytes(body)
    if not matches:
        return None
    if any("cp1252" in match.could_be_from_charset for match in matches):
        return _text_or_none(body.decode("cp1252", errors="replace"))
    best = matches.best()
    return None if best is None else _text_or_none(str(best))


def _text_or_none(text: str) -> Optional[str]:
    sample = text[:8192]
    controls = sum(1 for c in sample if ord(c) < 32 and c not in "\t\n\r\f")
    return None if sample and controls / len(sample) > 0.01 else text


def extract_main_text(html: str) -> Tuple[str, str]:
    """(title, main text) of an HTML page, without scripts, styles or hidden elements.

    Hidden parts (``display:none``, ``visibility:hidden``, ``hidden``, ``aria-hidden``,
    hidden inputs and the usual hiding classes) are removed with BeautifulSoup first,
    since trafilatura keeps them; trafilatura then keeps the main text (no menus,
    footers or comments).
    """
    try:
        import trafilatura
    except ImportError as exc:
        raise MissingDependency("web page extraction needs trafilatura: pip install 'llama-index-crag[web]'") from exc
    from bs4 import BeautifulSoup, Tag

    soup = BeautifulSoup(html, "html.parser")
    title = soup.title.get_text(" ", strip=True) if soup.title else ""
    for tag in soup(_DROPPED_TAGS):
        tag.decompose()
    for tag in soup.find_all(_is_hidden):
        # Not tag.decomposed: on a Tag that reads getattr(tag, "_decomposed"), which Tag.__getattr__ answers with
        # a search of the whole subtree for a tag of that name, once per tag (quadratic on deeply nested pages).
        if isinstance(tag, Tag) and not vars(tag).get("_decomposed", False):
            tag.decompose()
    text = trafilatura.extract(str(soup), include_comments=False, include_tables=True) or ""
    return title, text.strip()


def _is_hidden(tag: object) -> bool:
    from bs4 import Tag

    if not isinstance(tag, Tag):
        return False
    if tag.has_attr("hidden") or str(tag.get("aria-hidden", "")).lower() == "true":
        return True
    if tag.name == "input" and str(tag.get("type", "")).lower() == "hidden":
        return True
    if _HIDDEN_CLASSES.intersection(str(c).lower() for c in tag.get_attribute_list("class") if c):
        return True
    return bool(_HIDDEN_STYLE.search(str(tag.get("style", ""))))
