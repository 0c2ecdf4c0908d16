"""One chunker for every ingest (index folder, PostgreSQL, evaluation), one sentence splitter for every strip and
sentence the loop reads, and text as every store accepts it."""

from __future__ import annotations

import functools
import re
import unicodedata
from typing import Any, List, Sequence

from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.node_parser.text.utils import split_by_sentence_tokenizer_internal
from llama_index.core.schema import BaseNode, Document, NodeWithScore
from llama_index.core.utils import globals_helper

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


def splitter() -> SentenceSplitter:
    """The chunker: LlamaIndex's default ``SentenceSplitter`` with stable ids (``doc_id#n``), so a re-ingest of an
    unchanged document gives the same node ids."""
    return SentenceSplitter(id_func=lambda i, doc: f"{doc.doc_id}#{i}")


def chunk(documents: Sequence[Document]) -> List[BaseNode]:
    """``documents`` chunked as every ingest here chunks them (``splitter()``)."""
    return list(splitter().get_nodes_from_documents(documents))


#: Abbreviations that stand inside sentences of papers and encyclopaedias and NLTK's English model lacks ("e.g.
#: aspirin", "Smith et al. showed", "Fig. 2", "Mt. Everest"). "No." is not among them: "the answer was no." ends one.
_MORE_ABBREVIATIONS = frozenset(
    {"e.g", "i.e", "al", "fig", "figs", "mt", "approx", "ca", "cf", "ref", "refs", "vol", "eq", "pp"}
)
#: A numbered item's "No." or "Nos." ending a split, before the number that opens the next ("Regiments No. 13").
_NUMBER_SIGN = re.compile(r"\bNos?\.\s*$")


@functools.lru_cache(maxsize=1)
def _sentence_tokenizer() -> Any:
    """NLTK's trained English punkt model (``punkt_tab``, which LlamaIndex bundles) with ``_MORE_ABBREVIATIONS``.

    LlamaIndex's own ``split_by_sentence_tokenizer`` uses an untrained ``PunktSentenceTokenizer``, which knows no
    abbreviation and cuts "Dr. Smith", "the St. Lawrence" and "the U.S. Army" in two. Where the model cannot be
    loaded, that untrained tokenizer is used with the abbreviations added.
    """
    from nltk.tokenize import PunktSentenceTokenizer, PunktTokenizer

    globals_helper.wait_for_nltk_check()  # puts LlamaIndex's bundled NLTK data on NLTK's path
    try:
        tokenizer = PunktTokenizer("english")
    except LookupError:
        tokenizer = PunktSentenceTokenizer()
    # NLTK has no public way to add abbreviations to a loaded model; its parameters are a plain set.
    tokenizer._params.abbrev_types.update(_MORE_ABBREVIATIONS)
    return tokenizer


def split_sentences(text: str) -> List[str]:
    """``text`` in sentences: consecutive slices, each running to where the next begins (so together they are the
    text from its first sentence on, spaces kept), as LlamaIndex's splitter cuts them, with abbreviations known
    (``_sentence_tokenizer``) and a numbered item's "No." kept with its number."""
    sentences: List[str] = []
    for sentence in split_by_sentence_tokenizer_internal(text, _sentence_tokenizer()):
        if sentences and sentence[:1].isdigit() and _NUMBER_SIGN.search(sentences[-1]):
            sentences[-1] += sentence
        else:
            sentences.append(sentence)
    return sentences
