"""A file's text and title, by format: what ``llama-crag ingest`` and ``load_folder`` read from a folder.

Every format comes out as the same kind of plain text, which the chunker, the embedding model and the quoted
answers all read: one paragraph a line (the sentences of a paragraph rejoined, however the source broke its
lines or split it into inline elements), a blank line between blocks, headings on lines of their own written
as Markdown headings (``## Title``, the level kept), list items as ``- item``, table rows as ``cell | cell``,
and preformatted text (code, command synopses) as it was laid out.

- Plain text (``.txt``, ``.md``, ``.markdown``, ``.rst``, ``.csv``, ``.json``): as written, decoded as UTF-8
  (a byte that is not UTF-8 becomes U+FFFD); a NUL in the first 4 KiB is a binary file, skipped.
- HTML (``.html``, ``.htm``, ``.xhtml``): the page's main content (``<main>``, or a lone ``<article>``, else the
  body) without what only moves between pages: ``<nav>``, ``<aside>``, the site's ``<header>`` and
  ``<footer>``, navigation, banner and search landmarks, hidden elements, blocks whose class or id names
  navigation (``navheader``, ``breadcrumb``, ``sidebar``...), and lists or tables made mostly of links. The
  title is the page's ``<title>`` (else its first ``<h1>``). A definition list's terms are headings one level
  below the headings above them (``#### work_mem (integer)``): a reference page's entries (settings, options,
  functions) are chunked and quoted under their own names; a list inside a definition (an option's values) stays
  in its entry's text.
- PDF: the text layer of each page (pypdf), its lines rejoined into paragraphs; the title from the document's
  information. An encrypted PDF opens when it needs no password; one with no text layer at all (a scan) is
  skipped: run OCR on it first.
- Word (``.docx``, python-docx): paragraphs and tables in document order, ``Heading N`` styles as headings,
  list styles as items; the title from the document's properties, else its ``Title`` paragraph.
- PowerPoint (``.pptx``, python-pptx): each slide under a heading of its title (``Slide N`` without one), the
  text of its shapes and tables in reading order, then its speaker notes. Pictures are not described.

A file that cannot be read raises ``UnreadableFile`` saying why in words a user can act on.
"""

from __future__ import annotations

import logging
import re
import textwrap
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

#: Read as they are written.
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".csv", ".json")
HTML_SUFFIXES = (".html", ".htm", ".xhtml")
#: Every suffix read, and the format it is read as.
FORMATS: Dict[str, str] = {
    **{s: "text" for s in TEXT_SUFFIXES},
    **{s: "html" for s in HTML_SUFFIXES},
    ".pdf": "pdf",
    ".docx": "docx",
    ".pptx": "pptx",
}
#: Formats a user may bring that are not read, and what to do about each.
_NOT_READ = {
    ".doc": "an old binary Word file: save it as .docx",
    ".ppt": "an old binary PowerPoint file: save it as .pptx",
    ".xls": "a spreadsheet: export the sheets as .csv",
    ".xlsx": "a spreadsheet: export the sheets as .csv",
    ".odt": "an OpenDocument text: save it as .docx",
    ".rtf": "RTF: save it as .docx",
}
#: Bytes of a file looked at for a NUL, which plain text does not hold.
_SNIFF = 4096
#: The first bytes of an OLE2 compound file: an encrypted Office document, or an old .doc/.ppt renamed.
_OLE2 = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"
#: Pages of a PDF from which its reading gets a progress bar of its own.
PAGES_SHOWN = 20

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileText:
    """What a file says: its text and, where the format gives one, its title."""

    text: str
    title: Optional[str] = None


class UnreadableFile(Exception):
    """A file that is skipped; the message says why (one line, no file name)."""


def supported(path: Path) -> bool:
    """Whether ``path``'s suffix is a format that is read."""
    return path.suffix.lower() in FORMATS


def not_read_reason(path: Path) -> str:
    """Why a file of an unsupported suffix is skipped."""
    suffix = path.suffix.lower()
    if suffix in _NOT_READ:
        return _NOT_READ[suffix]
    return f"not a format ingest reads: {', '.join(FORMATS)}"


def read_file(path: Path, pages: Optional[Callable[[int], Any]] = None) -> FileText:
    """The text and title of ``path``, by its suffix, or ``UnreadableFile``.

    ``pages``, for a PDF of at least ``PAGES_SHOWN`` pages, is called with its page count and returns a progress
    bar (anything with ``update(n)`` and ``close()``) that its reading advances.
    """
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise UnreadableFile(not_read_reason(path))
    if kind == "pdf":
        return pdf_text(path, pages)
    if kind == "docx":
        return docx_text(path)
    if kind == "pptx":
        return pptx_text(path)
    raw = path.read_bytes()
    if b"\x00" in raw[:_SNIFF]:
        raise UnreadableFile("binary content")
    if kind == "html":
        return html_text(raw)
    return FileText(raw.decode("utf-8", errors="replace"))


# --- HTML -------------------------------------------------------------------------------------------------------

#: Elements whose content is never page text.
_DROPPED_TAGS = (
    "head", "script", "style", "noscript", "template", "svg", "canvas", "iframe", "object", "embed", "map",
    "button", "select", "input", "textarea", "nav", "aside", "menu", "dialog",
)  # fmt: skip
#: ARIA landmarks and widgets that hold navigation, the site's banner and footer, or search.
_DROPPED_ROLES = {"navigation", "banner", "contentinfo", "complementary", "search", "menu", "menubar", "toolbar"}
#: A class or id that names navigation (each class name is matched whole).
_NAVIGATION = re.compile(
    r"nav|navbar|navheader|navfooter|navigation|breadcrumbs?|crumbs|sidebar|side-bar|sphinxsidebar\w*|menu|menubar"
    r"|skip-?link|skip-?nav|skip-to-content|pagination|pager|related|headerlink|site-?(header|footer|nav)"
    r"|cookie-?(banner|notice|consent)|visually-hidden|sr-only|screen-reader-text",
    re.I,
)
_HIDDEN_STYLE = re.compile(r"display\s*:\s*none|visibility\s*:\s*hidden", re.I)
_HEADINGS = {f"h{n}": n for n in range(1, 7)}
#: Elements that end the paragraph before them and start a new one.
_BLOCKS = {
    "address", "article", "blockquote", "body", "caption", "center", "details", "div", "dl", "fieldset",
    "figcaption", "figure", "footer", "form", "header", "hr", "html", "legend", "main", "ol", "p", "section",
    "summary", "ul", "dd", "dt", "li", "tbody", "thead", "tfoot", "tr", "td", "th",
}  # fmt: skip
#: Links must be at least this share of a list's or table's letters for it to be navigation (two links or more).
_LINK_SHARE = 0.7
_LINE_BREAK = "\n"
#: The longest definition-list term written as a heading (a longer one is a paragraph).
_MAX_TERM = 150
_ALNUM = re.compile(r"[^\W_]+")


def html_text(html: bytes | str) -> FileText:
    """An HTML page's main text, structure kept (see the module's docstring), and its title.

    ``UnreadableFile`` when the page holds text but all of it is navigation. A page the parser rejects raises
    the parser's error (bs4's ``ParserRejectedMarkup``).
    """
    from bs4 import BeautifulSoup

    if isinstance(html, bytes):
        try:
            html = html.decode("utf-8")
        except UnicodeDecodeError:
            html = BeautifulSoup(html, "html.parser").decode()  # its declared charset, else a guess
    soup = BeautifulSoup(html, "html.parser")
    title = _title(soup)
    body = soup.body or soup
    had_text = bool(_words(body.get_text(" ")))
    for tag in soup(_DROPPED_TAGS):
        tag.decompose()
    root = _main(soup) or body
    _drop_boilerplate(root)
    writer = _Writer()
    writer.walk(root)
    text = writer.text()
    if not text and had_text:
        raise UnreadableFile("no text but navigation and page furniture")
    return FileText(text, title)


def _title(soup: Any) -> Optional[str]:
    for found in (soup.title, soup.find("h1")):
        if found is not None:
            title = " ".join(found.get_text(" ").split())
            if title:
                return title
    return None


def _words(text: str) -> int:
    """The letters and digits of ``text``."""
    return sum(map(len, _ALNUM.findall(text)))


def _main(soup: Any) -> Any:
    """The page's main content when it marks one: a single ``<main>`` (or ``role="main"``), else a single
    ``<article>``; None otherwise."""
    for found in (soup.find_all("main") or soup.find_all(attrs={"role": "main"}), soup.find_all("article")):
        if len(found) == 1 and _words(found[0].get_text(" ")):
            return found[0]
    return None


def _alive(tag: Any) -> bool:
    # Not tag.decomposed: on a Tag, a missing attribute is a search of its subtree for a tag of that name.
    return not vars(tag).get("_decomposed", False)


def _drop_boilerplate(root: Any) -> None:
    """Remove from ``root`` what moves between pages rather than says something (see ``html_text``)."""
    from bs4 import Tag

    for tag in list(root.find_all(True)):
        if not isinstance(tag, Tag) or not _alive(tag):
            continue
        role = str(tag.get("role", "")).lower()
        names = [str(c) for c in tag.get_attribute_list("class") if c] + [str(tag.get("id", ""))]
        if (
            role in _DROPPED_ROLES
            or any(_NAVIGATION.fullmatch(n) for n in names if n)
            or tag.has_attr("hidden")
            or str(tag.get("aria-hidden", "")).lower() == "true"
            or _HIDDEN_STYLE.search(str(tag.get("style", "")))
            or (tag.name in ("header", "footer") and tag.find_parent(["article", "section", "main"]) is None)
        ):
            tag.decompose()
    for tag in list(root.find_all(["ul", "ol", "dl", "table", "div", "p", "section", "menu", "td"])):
        if isinstance(tag, Tag) and _alive(tag) and _mostly_links(tag):
            tag.decompose()


def _mostly_links(tag: Any) -> bool:
    links = tag.find_all("a")
    if len(links) < 2:
        return False
    letters = _words(tag.get_text(" "))
    return letters > 0 and sum(_words(a.get_text(" ")) for a in links) >= _LINK_SHARE * letters


class _Writer:
    """Plain text out of an HTML tree: blocks apart, inline text joined, headings, lists, tables and code kept."""

    def __init__(self) -> None:
        self._parts: List[Tuple[str, str]] = []  # (separator before, block)
        self._line: List[str] = []
        self._tight = False  # the last block was a list item or table row
        self._prefix: List[str] = []  # list markers of the items being written, innermost last
        self._headings: List[Tuple[int, str]] = []  # the path of headings above the text being written
        self._level = 0  # the level of the last heading the page wrote (<h1> to <h6>)
        self._terms = 0  # how deep in definition lists the writer is
        self._term_at: Optional[int] = None  # the index in _parts of a term heading nothing has followed yet
        self._reopen: Optional[Tuple[int, str]] = None  # the heading to write again after a definition list

    def text(self) -> str:
        self._flush()
        return "".join(sep + block for sep, block in self._parts).lstrip("\n")

    def _emit(self, block: str, tight: bool = False) -> None:
        if not block:
            return
        if self._reopen is not None:  # text after a definition list belongs to the heading above the list
            level, title = self._reopen
            self._reopen = None
            self._heading(level, title)
        self._parts.append(("\n" if tight and self._tight else "\n\n", block))
        self._tight = tight
        self._term_at = None

    def _heading(self, level: int, title: str, term: bool = False) -> None:
        """A heading line, and the path of headings it puts the text after it under."""
        self._reopen = None
        if term and self._term_at is not None:  # terms of one entry ("-F format", "--format=format") are one
            level, before = self._headings[-1]
            title = f"{before}, {title}"
            self._parts[self._term_at] = (self._parts[self._term_at][0], "#" * level + " " + title)
        else:
            self._emit("#" * level + " " + title)
        self._headings = [(lv, t) for lv, t in self._headings if lv < level] + [(level, title)]
        self._term_at = len(self._parts) - 1 if term else None

    def _definitions(self, tag: Any) -> None:
        """A definition list: each term (``<dt>``) a heading one level below the headings above it, so that its
        definition is chunked, searched and quoted under the term's name (a setting, an option, a function:
        reference pages describe one in each entry). The text after the list goes back under the heading above. The
        terms of a list inside a definition (an option's values, a function's parameters) are not headings: they
        stay in their entry's text, which would otherwise be cut into a chunk a value."""
        above = self._headings[-1] if self._headings else None
        self._terms += 1
        self.walk(tag)
        self._flush()
        self._terms -= 1
        if self._headings and self._headings[-1] != above:
            self._reopen = above
            if above is None:
                self._headings = []

    def _flush(self) -> None:
        raw = "".join(self._line)
        self._line = []
        lines = [" ".join(part.split()) for part in raw.split(_LINE_BREAK)]
        block = "\n".join(line for line in lines if line)
        if not block:
            return
        if self._prefix:
            marker = self._prefix[-1]
            self._prefix[-1] = " " * len(marker)  # the item's later paragraphs are indented under it
            indent = "  " * (len(self._prefix) - 1)
            self._emit(indent + marker + block.replace("\n", "\n" + indent + " " * len(marker)), tight=True)
        else:
            self._emit(block)

    def walk(self, node: Any) -> None:
        from bs4 import NavigableString, Tag
        from bs4.element import PreformattedString

        for child in node.children:
            if isinstance(child, NavigableString):
                if not isinstance(child, PreformattedString):  # comments, doctypes, <?xml ...?>, CDATA
                    self._line.append(str(child).replace(_LINE_BREAK, " "))
                continue
            if not isinstance(child, Tag):
                continue
            name = child.name
            if name in _HEADINGS:
                self._flush()
                if not _inline(child):
                    continue
                if self._terms and self._headings:  # a heading inside a definition ("Note") sits under its term
                    self._heading(min(6, max(_HEADINGS[name], self._level + self._terms + 1)), _inline(child))
                else:
                    self._level = _HEADINGS[name]
                    self._heading(self._level, _inline(child))
            elif name == "dt" and self._terms == 1 and 0 < len(_joined_inline(child)) <= _MAX_TERM:
                self._flush()
                self._heading(min(6, self._level + self._terms), _joined_inline(child), term=True)
            elif name == "dl":
                self._flush()
                self._definitions(child)
            elif name == "br":
                self._line.append(_LINE_BREAK)
            elif name == "pre":
                self._flush()
                self._emit(_preformatted(child.get_text()))
            elif name == "table":
                self._flush()
                self._table(child)
            elif name in ("ul", "ol", "menu"):
                self._flush()
                self._list(child, ordered=name == "ol")
                self._tight = False
            elif name in _BLOCKS:
                self._flush()
                self.walk(child)
                self._flush()
            else:
                self.walk(child)

    def _list(self, tag: Any, ordered: bool) -> None:
        number = 0
        for item in tag.find_all("li", recursive=False):
            number += 1
            self._prefix.append(f"{number}. " if ordered else "- ")
            self.walk(item)
            self._flush()
            self._prefix.pop()
        for other in tag.find_all(True, recursive=False):  # stray content between items
            if other.name != "li":
                self.walk(other)
                self._flush()

    def _table(self, table: Any) -> None:
        rows = [tr for tr in table.find_all("tr") if tr.find_parent("table") is table]
        cells = [tr.find_all(["td", "th"], recursive=False) for tr in rows]
        layout = (
            str(table.get("role", "")).lower() in ("presentation", "none")
            or table.find("table") is not None
            or all(len(row) <= 1 for row in cells)
        )
        if layout:  # a table that lays out a page: its cells are blocks of their own
            for row in cells:
                for cell in row:
                    self.walk(cell)
                    self._flush()
            return
        caption = table.find("caption")
        if caption is not None and _inline(caption):
            self._emit(_inline(caption))
        self._tight = False
        for row in cells:
            texts = [_inline(cell) for cell in row]
            if any(texts):
                self._emit(" | ".join(texts), tight=True)
        self._tight = False


def _inline(tag: Any) -> str:
    return " ".join(tag.get_text(" ").split())


def _joined_inline(tag: Any) -> str:
    """A tag's text as a paragraph writes it: inline elements joined as the source joins them
    ("shared_buffers (integer)", not "shared_buffers ( integer )"), a line break a space."""
    for br in tag.find_all("br"):
        br.replace_with(" ")
    return " ".join(tag.get_text().split())


def _preformatted(text: str) -> str:
    lines = [line.rstrip() for line in text.expandtabs(8).split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return textwrap.dedent("\n".join(lines))


# --- PDF --------------------------------------------------------------------------------------------------------

#: A line at least this share of its page's usual line length runs on into the next (a wrapped paragraph).
_FULL_LINE = 0.75


def pdf_text(path: Path, pages: Optional[Callable[[int], Any]] = None) -> FileText:
    """The text layer of a PDF, page by page, with wrapped lines rejoined (see the module's docstring)."""
    from pypdf import PdfReader
    from pypdf.errors import DependencyError

    with _quiet("pypdf"):
        try:
            reader = PdfReader(str(path))
            if reader.is_encrypted:
                try:
                    opened = reader.decrypt("")
                except DependencyError as exc:
                    raise UnreadableFile(
                        "encrypted with AES: opening it needs the cryptography package (pip install cryptography)"
                    ) from exc
                if not opened:
                    raise UnreadableFile("encrypted: it needs a password to open; save an unprotected copy")
            count = len(reader.pages)
        except UnreadableFile:
            raise
        except Exception as exc:  # pypdf raises its own errors and plain ones alike on a malformed file
            raise UnreadableFile(f"not a readable PDF ({type(exc).__name__}: {_first_line(exc)})") from exc
        if count == 0:
            raise UnreadableFile("a PDF with no pages")
        bar = pages(count) if pages is not None and count >= PAGES_SHOWN else None
        texts, failed = [], 0
        try:
            for page in reader.pages:
                try:
                    texts.append(_paragraphs(page.extract_text() or ""))
                except Exception:  # one damaged page (a broken content stream or font): the others are read
                    failed += 1
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
    text = "\n\n".join(t for t in texts if t)
    if not text.strip():
        if failed == count:
            raise UnreadableFile(f"none of its {count} pages could be read (damaged)")
        raise UnreadableFile(
            f"no text layer in its {count} page{'s' if count > 1 else ''} (a scan or images only): run OCR on it "
            "first (for example ocrmypdf)"
        )
    if failed:
        logger.warning("%s: %d of its %d pages could not be read and are left out", path.name, failed, count)
    return FileText(text, _pdf_title(reader))


def _pdf_title(reader: Any) -> Optional[str]:
    try:
        title = reader.metadata.title if reader.metadata is not None else None
    except Exception:  # a damaged information dictionary: no title
        return None
    title = " ".join(str(title).split()) if title else ""
    return title or None


def _paragraphs(page: str) -> str:
    """A page's lines as paragraphs: a line as long as the page's usual full line runs on into the next."""
    lines = [" ".join(line.split()) for line in page.splitlines()]
    lengths = sorted(len(line) for line in lines if line)
    if not lengths:
        return ""
    full = lengths[int(0.9 * (len(lengths) - 1))] * _FULL_LINE
    out: List[str] = []
    joining = False
    for line in lines:
        if not line:
            joining = False
            if out and out[-1]:
                out.append("")
            continue
        if joining and out:
            out[-1] += ("" if out[-1].endswith("-") else " ") + line
        else:
            out.append(line)
        joining = len(line) >= full
    return "\n".join(out).strip()


# --- Word and PowerPoint ----------------------------------------------------------------------------------------

_HEADING_STYLE = re.compile(r"heading\s*([1-6])", re.I)


def docx_text(path: Path) -> FileText:
    """A Word document's paragraphs and tables in order (see the module's docstring)."""
    from docx import Document as open_docx
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    with _office(path, "Word"):
        document = open_docx(str(path))
        blocks: List[Tuple[str, bool]] = []  # (block, tight)
        title = ""
        for item in document.iter_inner_content():
            if isinstance(item, Table):
                blocks.extend((row, True) for row in _table_rows(item))
                blocks.append(("", False))
                continue
            if not isinstance(item, Paragraph):
                continue
            text = "\n".join(" ".join(line.split()) for line in item.text.split("\n")).strip()
            if not text:
                continue
            style = _style_name(item)
            heading = _HEADING_STYLE.match(style)
            if style.lower() == "title":
                title = title or text
                blocks.append(("# " + text, False))
            elif heading:
                blocks.append(("#" * int(heading.group(1)) + " " + text, False))
            elif style.lower().startswith("list"):
                blocks.append(("- " + text, True))
            else:
                blocks.append((text, False))
        core = (document.core_properties.title or "").strip()
    return FileText(_joined(blocks), " ".join(core.split()) or title or None)


def pptx_text(path: Path) -> FileText:
    """A presentation's slides, each under its title (see the module's docstring)."""
    from pptx import Presentation

    with _office(path, "PowerPoint"):
        presentation = Presentation(str(path))
        blocks: List[Tuple[str, bool]] = []
        first_title = ""
        for number, slide in enumerate(presentation.slides, 1):
            heading = slide.shapes.title
            title = " ".join(heading.text_frame.text.split()) if heading is not None and heading.has_text_frame else ""
            first_title = first_title or title
            blocks.append(("## " + (title or f"Slide {number}"), False))
            for shape in sorted(_shapes(slide.shapes), key=lambda s: (s.top or 0, s.left or 0)):
                if heading is not None and shape.shape_id == heading.shape_id:
                    continue
                if getattr(shape, "has_table", False) and shape.has_table:
                    blocks.extend((row, True) for row in _table_rows(shape.table))
                    blocks.append(("", False))
                elif shape.has_text_frame:
                    for paragraph in shape.text_frame.paragraphs:
                        text = " ".join(paragraph.text.split())
                        if text:
                            blocks.append(("  " * paragraph.level + "- " + text, True))
                    blocks.append(("", False))
            if slide.has_notes_slide and slide.notes_slide.notes_text_frame is not None:
                notes = " ".join(slide.notes_slide.notes_text_frame.text.split())
                if notes:
                    blocks.append(("Notes: " + notes, False))
        core = (presentation.core_properties.title or "").strip()
    text = _joined(blocks)
    if not any(line and not line.startswith("## Slide ") for line in text.splitlines()):
        return FileText("", None)  # slides without a word: nothing to index
    return FileText(text, " ".join(core.split()) or first_title or None)


def _shapes(shapes: Any) -> Iterator[Any]:
    """The shapes of a slide, groups opened."""
    for shape in shapes:
        if getattr(shape, "shape_type", None) == 6:  # MSO_SHAPE_TYPE.GROUP
            yield from _shapes(shape.shapes)
        else:
            yield shape


def _table_rows(table: Any) -> List[str]:
    rows = []
    for row in table.rows:
        texts: List[str] = []
        seen: List[Any] = []
        for cell in row.cells:
            inner = getattr(cell, "_tc", cell)
            if any(inner is s for s in seen):  # a merged cell is listed once per grid column it spans
                continue
            seen.append(inner)
            texts.append(" ".join(cell.text.split()))
        if any(texts):
            rows.append(" | ".join(texts))
    return rows


def _style_name(paragraph: Any) -> str:
    try:
        return str(paragraph.style.name) if paragraph.style is not None else ""
    except Exception:  # a style the document names but does not define
        return ""


def _joined(blocks: Sequence[Tuple[str, bool]]) -> str:
    out: List[str] = []
    tight_before = False
    for block, tight in blocks:
        if not block:
            tight_before = False
            continue
        out.append(("\n" if tight and tight_before else "\n\n") + block)
        tight_before = tight
    return "".join(out).strip("\n")


@contextmanager
def _office(path: Path, kind: str) -> Iterator[None]:
    """Turns what the Office readers raise on a file they cannot open into ``UnreadableFile``, saying why."""
    try:
        yield
    except UnreadableFile:
        raise
    except Exception as exc:  # python-docx and python-pptx raise zip, XML, key and package errors alike
        try:
            with path.open("rb") as f:
                head = f.read(len(_OLE2))
        except OSError:
            head = b""
        if head == _OLE2:
            raise UnreadableFile(
                f"protected by a password, or an old binary {kind} file renamed {path.suffix}: save an unprotected "
                f"{path.suffix} copy"
            ) from exc
        if not zipfile.is_zipfile(path):
            raise UnreadableFile(f"not a {kind} file (damaged, or another format named {path.suffix})") from exc
        raise UnreadableFile(f"a damaged {kind} file ({type(exc).__name__}: {_first_line(exc)})") from exc


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """The named library's warnings about a malformed file kept off the terminal while it is read."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:160] if text else "no detail"
