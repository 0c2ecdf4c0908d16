"""Text as every store, tokenizer and codec here accepts it, and text that says nothing."""

from __future__ import annotations

import re
import unicodedata
from typing import Any, List, Sequence

from llama_index.core.schema import BaseNode, NodeWithScore

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


def clean_node(node: BaseNode) -> BaseNode:
    """``node`` with its text and metadata as ``clean_text`` leaves them: the node itself when nothing changes,
    else a cleaned copy under the same id (the caller's node is left as it is)."""
    update: dict[str, Any] = {}
    text = getattr(node, "text", None)
    if isinstance(text, str) and clean_text(text) != text:
        update["text"] = clean_text(text)
    metadata = {k: clean_text(v) if isinstance(v, str) else v for k, v in node.metadata.items()}
    if metadata != node.metadata:
        update["metadata"] = metadata
    return node.model_copy(update=update) if update else node


def clean_nodes(hits: Sequence[NodeWithScore]) -> List[NodeWithScore]:
    """What a retriever found, cleaned (``clean_node``): one that does not embed (BM25, a remote store) can hand
    back a lone surrogate that the embedding model's tokenizer and UTF-8 refuse."""
    cleaned: List[NodeWithScore] = []
    for hit in hits:
        node = clean_node(hit.node)
        cleaned.append(hit if node is hit.node else NodeWithScore(node=node, score=hit.score))
    return cleaned


def is_blank(text: str) -> bool:
    """Whether ``text`` says nothing: only whitespace, invisible format characters (zero-width spaces and
    joiners, a byte-order mark, direction marks) and U+FFFD (what ``clean_text`` leaves of a lone surrogate),
    which a pasted or generated query can consist of."""
    return all(c.isspace() or c == "\ufffd" or unicodedata.category(c) == "Cf" for c in text)
