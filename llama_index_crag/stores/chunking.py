"""One chunker for every ingest (index folder, PostgreSQL, evaluation), so that chunks match the in-memory engine's."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import BaseNode, Document


def splitter() -> SentenceSplitter:
    """The chunker: LlamaIndex's default ``SentenceSplitter`` with stable ids (``doc_id#n``), so a re-ingest of an
    unchanged document gives the same node ids."""
    return SentenceSplitter(id_func=lambda i, doc: f"{doc.doc_id}#{i}")


def chunk(documents: Sequence[Document]) -> List[BaseNode]:
    """``documents`` chunked as every ingest here chunks them (``splitter()``)."""
    return list(splitter().get_nodes_from_documents(documents))


def describe() -> Dict[str, Any]:
    """How ``chunk`` cuts documents, for a fingerprint of what an index was built with."""
    parts = splitter()
    return {"chunker": type(parts).__name__, "chunk_size": parts.chunk_size, "chunk_overlap": parts.chunk_overlap}
