"""One chunker for every ingest (index folder, PostgreSQL, evaluation), and text as every store accepts it."""

from __future__ import annotations

import re
from typing import List, Sequence

from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import BaseNode, Document

_UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """``text`` as every store, tokenizer and codec here accepts it.

    Control characters other than tab and line breaks (NUL among them, which PostgreSQL
    refuses in text) become spaces, so that the words on either side stay apart; lone
    UTF-16 surrogates (which JSON's ``\\ud800`` escapes produce and UTF-8 cannot encode)
    become U+FFFD.
    """
    if text.isascii() and text.isprintable():
        return text
    return _UNSAFE.sub(lambda m: "\ufffd" if "\ud800" <= m.group() <= "\udfff" else " ", text)


def splitter() -> SentenceSplitter:
    """The chunker: LlamaIndex's default ``SentenceSplitter`` with stable ids (``doc_id#n``), so a re-ingest of an
    unchanged document gives the same node ids."""
    return SentenceSplitter(id_func=lambda i, doc: f"{doc.doc_id}#{i}")


def chunk(documents: Sequence[Document]) -> List[BaseNode]:
    """``documents`` chunked as every ingest here chunks them (``splitter()``)."""
    return list(splitter().get_nodes_from_documents(documents))
