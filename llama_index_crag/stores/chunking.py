"""One chunker for every ingest (index folder, PostgreSQL, evaluation), so that chunks match the in-memory engine's.

Chunks are cut to what the embedding model reads. The bundled MiniLM reads 256 word pieces and silently drops the
rest, so a longer chunk is searched and graded by its beginning alone (LlamaIndex's default ``SentenceSplitter``
cuts 1,024 tokens: three quarters of every full chunk went unseen). Here each chunk's embedded text (its
metadata, title and section heading, then its text) fits the model's window, counted with the model's own
tokenizer (``scorers.bi_encoder.EmbeddingWindow``; an estimate for a model whose tokenizer cannot be read).

How a document is cut (the text as ``stores/readers.py`` writes every format: blocks apart by a blank line,
headings as Markdown heading lines, list items and table rows one a line, preformatted text as laid out):

- A heading starts a new chunk, and the path of headings above a chunk (``Backup > SQL Dump``) travels with it
  as its ``section`` metadata, which the embedding model, the grader and the LLM read beside the title.
- Prose is packed in whole sentences up to the window; the next chunk of the same section starts with the last
  sentences of the one before (``OVERLAP_SHARE`` of the window).
- Table rows (``cell | cell``, or Markdown ``| cell |``), code fences and preformatted or list lines are never
  cut inside a line: a table or code block that fits a chunk of its own is not split at all, and a table
  continued in the next chunk repeats its header row there.
- A single sentence or line longer than the window is cut at word boundaries, no text lost.

Ids stay stable (``doc_id#n``), so a re-ingest of an unchanged document gives the same node ids.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.node_parser import NodeParser
from llama_index.core.node_parser.node_utils import build_nodes_from_splits
from llama_index.core.schema import BaseNode, Document, MetadataMode, TextNode

from llama_index_crag.scorers.bi_encoder import EmbeddingWindow, embedding_window
from llama_index_crag.text.headings import heading
from llama_index_crag.text.split import split_sentences

#: Raised whenever the same text would be cut differently, so that what records how an index was cut
#: (``describe``: the raw-document evaluation names its index folder by it) tells the cuts apart.
VERSION = 1
#: The metadata key that holds a chunk's heading path (set only where the document does not set it itself).
SECTION = "section"
#: How the headings of a path are joined.
SECTION_JOIN = " > "
#: The share of the window that the next chunk of a section repeats from the end of the one before.
OVERLAP_SHARE = 0.125
#: The fewest word pieces a chunk's own text may have, however long its metadata (a title longer than the window
#: would otherwise leave no room at all; such a chunk's metadata is then what overflows).
MIN_BUDGET = 32

_FENCE = re.compile(r"^[ \t]*(```|~~~)")
_TABLE_RULE = re.compile(r"^[ \t]*\|?[ \t]*:?-{3,}:?[ \t]*(\|[ \t]*:?-{3,}:?[ \t]*)*\|?[ \t]*$")

PROSE, LINE, ROW, HEADING = "prose", "line", "row", "heading"


@dataclass
class _Unit:
    """A piece of a document's text a chunk is made of: a sentence, a line, a table row or a heading."""

    start: int
    end: int
    kind: str
    section: Tuple[str, ...]
    #: The block (paragraph, table, code) it belongs to, and for a table row the block's header row.
    block: int
    header: Optional[Tuple[int, int]] = None
    tokens: int = 0


class WindowChunker(NodeParser):
    """Cuts documents into chunks whose embedded text fits the embedding model's window (see the module)."""

    _window: Optional[EmbeddingWindow] = PrivateAttr(default=None)
    _embed_model: Optional[BaseEmbedding] = PrivateAttr(default=None)

    def __init__(self, embed_model: Optional[BaseEmbedding] = None, **kwargs: Any) -> None:
        super().__init__(id_func=lambda i, doc: f"{doc.doc_id}#{i}", **kwargs)
        self._embed_model = embed_model

    @classmethod
    def class_name(cls) -> str:
        return "WindowChunker"

    @property
    def window(self) -> EmbeddingWindow:
        if self._window is None:
            self._window = embedding_window(self._embed_model or _settings_embed_model())
        return self._window

    def describe(self) -> Dict[str, Any]:
        return {
            "chunker": self.class_name(),
            "version": VERSION,
            **self.window.describe(),
            "overlap_share": OVERLAP_SHARE,
        }

    def _parse_nodes(self, nodes: Sequence[BaseNode], show_progress: bool = False, **kwargs: Any) -> List[BaseNode]:
        found: List[BaseNode] = []
        for node in nodes:
            found.extend(self._chunk_one(node))
        return found

    def _chunk_one(self, document: BaseNode) -> List[BaseNode]:
        text = document.get_content(metadata_mode=MetadataMode.NONE)
        units = _units(text)
        if not units:
            return []
        sizes = self.window.counts([text[u.start : u.end] for u in units])
        for unit, size in zip(units, sizes):
            unit.tokens = size
        budgets: Dict[Tuple[str, ...], int] = {}

        def budget(section: Tuple[str, ...]) -> int:
            if section not in budgets:
                budgets[section] = self._budget(document, section)
            return budgets[section]

        units = self._fit_units(text, units, budget)
        pieces = self._pack(text, units, budget)
        texts = [t for t, _ in pieces]
        built = build_nodes_from_splits(texts, document, id_func=self.id_func)
        for node, (_, section) in zip(built, pieces):
            _label(node, document, section)
        return self._checked(built, document)

    def _budget(self, document: BaseNode, section: Tuple[str, ...]) -> int:
        """The word pieces a chunk's own text may take in ``section``: the window less its metadata's."""
        probe = TextNode(
            text="",
            metadata=dict(document.metadata),
            excluded_embed_metadata_keys=list(document.excluded_embed_metadata_keys),
            metadata_template=document.metadata_template,
            metadata_separator=document.metadata_separator,
        )
        probe.text_template = getattr(document, "text_template", probe.text_template)
        _label(probe, document, section)
        overhead = self.window.count(probe.get_content(metadata_mode=MetadataMode.EMBED))
        return max(MIN_BUDGET, self.window.tokens - overhead)

    def _fit_units(self, text: str, units: List[_Unit], budget_of: Callable[[Tuple[str, ...]], int]) -> List[_Unit]:
        """Units longer than their chunk's budget cut at word boundaries (pieces of a row stay rows)."""
        fitted: List[_Unit] = []
        for unit in units:
            budget = budget_of(unit.section)
            if unit.tokens <= budget:
                fitted.append(unit)
                continue
            start = unit.start
            pieces = self.window.hard_cut(text[unit.start : unit.end], budget)
            for piece, size in zip(pieces, self.window.counts(pieces)):
                begin = text.index(piece, start)
                fitted.append(_Unit(begin, begin + len(piece), unit.kind, unit.section, unit.block, None, size))
                start = begin + len(piece)
        return fitted

    def _pack(
        self, text: str, units: List[_Unit], budget_of: Callable[[Tuple[str, ...]], int]
    ) -> List[Tuple[str, Tuple[str, ...]]]:
        """Units packed into chunks: (text, section) each."""
        chunks: List[Tuple[str, Tuple[str, ...]]] = []
        current: List[_Unit] = []
        header: Optional[_Unit] = None  # a continued table's header row, repeated at the top of this chunk

        def size() -> int:
            return sum(u.tokens for u in current) + (header.tokens if header else 0)

        def flush(last: bool = False) -> None:
            nonlocal current, header
            # Headings alone wait for their section's text; a document of nothing but headings keeps them.
            if current and (any(u.kind != HEADING for u in current) or (last and not chunks)):
                body = text[current[0].start : current[-1].end].rstrip()
                # Laid-out lines keep their indentation; anything else starts at its first word.
                body = body.lstrip("\r\n") if current[0].kind == LINE else body.lstrip()
                if header is not None:
                    body = text[header.start : header.end].strip() + "\n" + body
                section = next((u.section for u in current if u.kind != HEADING), current[0].section)
                chunks.append((body, section))
            current, header = [], None

        for i, unit in enumerate(units):
            budget = budget_of(unit.section)
            if unit.kind == HEADING and any(u.kind != HEADING for u in current):
                flush()
            elif current and current[-1].block != unit.block and unit.kind in (ROW, LINE):
                # A table or code block that fits a chunk of its own starts one rather than being split.
                whole = sum(u.tokens for u in units[i:] if u.block == unit.block)
                if size() + whole > budget and whole <= budget:
                    flush()
            if current and size() + unit.tokens > budget:
                carried = _overlap(current, int(self.window.tokens * OVERLAP_SHARE), unit)
                continued = _header_row(current, units, unit)
                flush()
                current = carried
                if continued is not None and continued.tokens + unit.tokens <= budget:
                    header = continued
                while current and size() + unit.tokens > budget:
                    current.pop(0)
            current.append(unit)
        flush(last=True)
        return chunks

    def _checked(self, nodes: List[TextNode], document: BaseNode) -> List[BaseNode]:
        """Every chunk's embedded text counted again as a whole (word pieces do not always add up across the
        spaces between units); one still over the window is cut at word boundaries, keeping the ids in order."""
        texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]
        over = self.window.over(texts)
        if not any(over):
            return list(nodes)
        splits: List[str] = []
        sections: List[Tuple[str, ...]] = []
        for node, long in zip(nodes, over):
            section = tuple(str(node.metadata.get(SECTION, "")).split(SECTION_JOIN)) if SECTION in node.metadata else ()
            own = node.get_content(metadata_mode=MetadataMode.NONE)
            if long:
                budget = self._budget(document, section) - 2
                parts = self.window.hard_cut(own, budget)
            else:
                parts = [own]
            splits.extend(parts)
            sections.extend([section] * len(parts))
        rebuilt = build_nodes_from_splits(splits, document, id_func=self.id_func)
        for node, section in zip(rebuilt, sections):
            _label(node, document, section)
        return list(rebuilt)


def _overlap(current: List[_Unit], tokens: int, following: _Unit) -> List[_Unit]:
    """The last prose sentences of ``current`` (at most ``tokens`` word pieces, never all of it) that the next
    chunk repeats, when it goes on in the same section and block kind."""
    if following.kind != PROSE or tokens <= 0:
        return []
    carried: List[_Unit] = []
    total = 0
    for unit in reversed(current[1:]):
        if unit.kind != PROSE or unit.section != following.section or total + unit.tokens > tokens:
            break
        carried.insert(0, unit)
        total += unit.tokens
    return carried


def _header_row(current: List[_Unit], units: List[_Unit], following: _Unit) -> Optional[_Unit]:
    """The header row of the table ``following`` continues, when the chunk being closed holds part of it."""
    if following.kind != ROW or following.header is None or not current or current[-1].block != following.block:
        return None
    start, end = following.header
    return next((u for u in units if u.start == start and u.end == end), None)


def _label(node: BaseNode, document: BaseNode, section: Tuple[str, ...]) -> None:
    """Give ``node`` its heading path as ``section`` (shown to the embedding model and the LLM), unless the
    document sets a ``section`` of its own; the exclusion lists are the node's own copies."""
    node.excluded_embed_metadata_keys = list(node.excluded_embed_metadata_keys)
    node.excluded_llm_metadata_keys = list(node.excluded_llm_metadata_keys)
    node.metadata = dict(document.metadata)
    if SECTION in document.metadata or not section:
        return
    node.metadata[SECTION] = SECTION_JOIN.join(section)
    for hidden in (node.excluded_embed_metadata_keys, node.excluded_llm_metadata_keys):
        if SECTION in hidden:
            hidden.remove(SECTION)


def _units(text: str) -> List[_Unit]:
    """``text`` as units: headings, sentences of prose, lines of code, lists and preformatted text, table rows;
    each with the heading path above it and the block it belongs to."""
    units: List[_Unit] = []
    path: List[Tuple[int, str]] = []
    lines = _lines(text)
    block, i = 0, 0
    while i < len(lines):
        start, end = lines[i]
        line = text[start:end]
        section = tuple(title for _, title in path)
        if not line.strip():
            block += 1
            i += 1
            continue
        found = heading(line, _line(text, lines, i - 1), _line(text, lines, i + 1))
        if found:
            level, title = found
            path = [(lv, t) for lv, t in path if lv < level] + [(level, title)]
            block += 1
            units.append(_Unit(start, end, HEADING, tuple(t for _, t in path), block))
            i += 1
            continue
        if _FENCE.match(line):  # a fenced code block, to its closing fence (or the end)
            block += 1
            closing = next((j for j in range(i + 1, len(lines)) if _FENCE.match(text[slice(*lines[j])])), len(lines))
            for j in range(i, min(closing + 1, len(lines))):
                if text[slice(*lines[j])].strip():
                    units.append(_Unit(*lines[j], LINE, section, block))
            block += 1
            i = closing + 1
            continue
        run = i  # the block: lines up to a blank line or a fence
        while run < len(lines) and text[slice(*lines[run])].strip():
            if run > i and _FENCE.match(text[slice(*lines[run])]):
                break
            run += 1
        block += 1
        units.extend(_block_units(text, lines[i:run], section, block))
        i = run
    return units


def _line(text: str, lines: List[Tuple[int, int]], i: int) -> Optional[str]:
    """Line ``i`` of ``text``, or None past its edges."""
    return text[slice(*lines[i])] if 0 <= i < len(lines) else None


def _block_units(text: str, lines: List[Tuple[int, int]], section: Tuple[str, ...], block: int) -> List[_Unit]:
    """One block's units: a table's rows (with its header row), lines of a list or of preformatted text, or the
    sentences of each paragraph line."""
    texts = [text[s:e] for s, e in lines]
    if len(texts) >= 2 and sum("|" in t for t in texts) >= max(2, len(texts) - 1):
        header = lines[0]
        if len(texts) > 1 and _TABLE_RULE.match(texts[1]):
            header = (lines[0][0], lines[1][1])  # a Markdown table's header and its rule travel together
        rows = [_Unit(s, e, ROW, section, block, header) for s, e in lines]
        if header != lines[0]:
            rows = [_Unit(header[0], header[1], ROW, section, block, header)] + rows[2:]
        return rows
    if any(t[:1] in (" ", "\t") for t in texts):  # laid out (code, a command's synopsis, an item's paragraphs)
        return [_Unit(s, e, LINE, section, block) for s, e in lines]
    units: List[_Unit] = []
    for s, e in lines:
        sentences = split_sentences(text[s:e])
        joined = "".join(sentences)
        if not sentences or not text[s:e].endswith(joined):  # not consecutive slices: the line is one unit
            units.append(_Unit(s, e, PROSE, section, block))
            continue
        at = e - len(joined)
        for sentence in sentences:
            if sentence.strip():
                units.append(_Unit(at, at + len(sentence), PROSE, section, block))
            at += len(sentence)
    return units


def _lines(text: str) -> List[Tuple[int, int]]:
    """Each line of ``text`` as (start, end), the newline left out."""
    found, start = [], 0
    for match in re.finditer(r"\r?\n", text):
        found.append((start, match.start()))
        start = match.end()
    found.append((start, len(text)))
    return found


def _settings_embed_model() -> Optional[BaseEmbedding]:
    """``Settings.embed_model`` when a user set one, else None: the bundled model's window."""
    from llama_index_crag.local.models import settings_embed_model

    return settings_embed_model()


def splitter(embed_model: Optional[BaseEmbedding] = None) -> WindowChunker:
    """The chunker: chunks whose embedded text fits the window of ``embed_model`` (``Settings.embed_model`` when
    set, else the bundled MiniLM), with stable ids (``doc_id#n``)."""
    return WindowChunker(embed_model)


def chunk(documents: Sequence[Document], embed_model: Optional[BaseEmbedding] = None) -> List[BaseNode]:
    """``documents`` chunked as every ingest here chunks them (``splitter()``)."""
    return list(splitter(embed_model).get_nodes_from_documents(documents))


def describe(embed_model: Optional[BaseEmbedding] = None) -> Dict[str, Any]:
    """How ``chunk`` cuts documents, for a fingerprint of what an index was built with."""
    return splitter(embed_model).describe()


def fingerprint(embed_model: Optional[BaseEmbedding] = None) -> str:
    """A short digest of ``describe``: an index records it, and a re-ingest under another cut chunks every
    document again instead of mixing chunks cut two ways."""
    return hashlib.sha256(json.dumps(describe(embed_model), sort_keys=True).encode()).hexdigest()[:10]
