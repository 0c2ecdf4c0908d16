"""The engine over PostgreSQL with pgvector: chunks, windows, full-text search and word statistics in one store.

One store is a handful of tables named after it (``crag`` by default), laid out in
``store.py``; ``ingest.py`` fills them, ``retrievers.py`` reads them (pgvector, sentence
windows, full-text search), ``grading.py`` grades with the stored embeddings and the
IDF of the query's words only; ``core/persisted.py`` builds the corrective engine over them.
psycopg is imported on first connection: install the ``[postgres]`` extra.
"""

from __future__ import annotations

from typing import Any, Dict

from llama_index_crag._lazy import LazyExports

#: Each public name and its module, loaded on first use (so that importing one part does not load the engine).
_EXPORTS: Dict[str, str] = {
    "DEFAULT_TABLE": "llama_index_crag.stores.postgres.store",
    "FORMAT": "llama_index_crag.stores.postgres.store",
    "PRECISIONS": "llama_index_crag.stores.postgres.store",
    "PostgresFullTextRetriever": "llama_index_crag.stores.postgres.retrievers",
    "PostgresSentenceWindowRetriever": "llama_index_crag.stores.postgres.retrievers",
    "PostgresStore": "llama_index_crag.stores.postgres.store",
    "PostgresVectorRetriever": "llama_index_crag.stores.postgres.retrievers",
    "StoreError": "llama_index_crag.stores.postgres.store",
    "StoreUnavailableError": "llama_index_crag.stores.postgres.store",
    "StoredEvidence": "llama_index_crag.stores.postgres.grading",
    "StoredIdf": "llama_index_crag.stores.postgres.grading",
    "candidate_lexemes": "llama_index_crag.stores.postgres.retrievers",
    "ingest": "llama_index_crag.stores.postgres.ingestion",
    "store_size": "llama_index_crag.stores.postgres.retrievers",
    "stored_scorer": "llama_index_crag.stores.postgres.grading",
}

__all__ = [
    "DEFAULT_TABLE",
    "FORMAT",
    "PRECISIONS",
    "PostgresFullTextRetriever",
    "PostgresSentenceWindowRetriever",
    "PostgresStore",
    "PostgresVectorRetriever",
    "StoreError",
    "StoreUnavailableError",
    "StoredEvidence",
    "StoredIdf",
    "candidate_lexemes",
    "ingest",
    "store_size",
    "stored_scorer",
]


_lazy = LazyExports(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    return _lazy.get(name)


def __dir__() -> list[str]:
    return _lazy.names()
