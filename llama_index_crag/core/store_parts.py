"""The engine's parts over a PostgreSQL store: retrieval, fallback and grading that read the store and nothing else
(``core/builder.py`` wires them for ``from_defaults(vector_store=...)``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.postprocessor.types import BaseNodePostprocessor

from llama_index_crag.core.fallback import FallbackRetriever
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.scope import UNBOUNDED, Scope, ScopeLike, retriever_scope
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.stores.postgres.grading import StoredEvidence, StoredIdf, stored_scorer
from llama_index_crag.stores.postgres.retrievers import (
    PostgresFullTextRetriever,
    PostgresSentenceWindowRetriever,
    PostgresVectorRetriever,
)
from llama_index_crag.stores.postgres.store import DEFAULT_TABLE, PostgresStore


@dataclass
class StoreParts:
    """What the engine needs from a store: its retriever, fallback, scorer and the postprocessors before grading."""

    store: PostgresStore
    embed_model: BaseEmbedding
    retriever: BaseRetriever
    fallback: BaseRetriever
    scorer: RelevanceScorer
    postprocessors: List[BaseNodePostprocessor]


def store_parts(
    store: Union[str, PostgresStore, Any],
    embed_model: Optional[BaseEmbedding] = None,
    scorer: Optional[RelevanceScorer] = None,
    fallback_sources: Sequence[str] = ("fulltext", "sentence_window"),
    grader: Optional[str] = None,
    table: str = DEFAULT_TABLE,
    settings: Optional[Mapping[str, Any]] = None,
    calibration_path: Optional[str] = None,
    postprocessors: Optional[Sequence[BaseNodePostprocessor]] = None,
    retriever: Optional[BaseRetriever] = None,
    scope: ScopeLike = None,
) -> StoreParts:
    """The engine's parts over ``store`` (a ``postgresql://`` URL, a ``PostgresStore`` or a ``PGVectorStore``).

    Retrieval is pgvector's; the fallback is full-text search and sentence windows in
    PostgreSQL; grading reuses the stored embeddings and reads the IDF of the query's words only.
    ``settings`` and ``calibration_path`` are the engine's, read here for ``similarity_top_k`` and
    ``fallback_widen``.

    ``scope`` (a ``Scope``, or anything ``scope.as_filters`` reads) bounds every retriever built here: each
    searches inside it in its SQL. A given ``retriever`` is the primary retriever as it is, never replaced;
    the store's fallback retrievers then search inside ``scope`` and the retriever's own scope (where
    ``scope.retriever_scope`` can read it). Where neither is known, the fallback goes back through the
    given retriever only: searching the store around it could return what it never would.
    """
    from llama_index_crag.local.models import default_embed_model

    if isinstance(store, str):
        store = PostgresStore(store, table=table)
    elif not isinstance(store, PostgresStore):
        store = PostgresStore.from_vector_store(store)
    embed_model = embed_model or default_embed_model()
    store.require(embed_model)
    stored_idf: Optional[StoredIdf] = None
    if scorer is None:
        # Word statistics are document frequencies over the whole store, whatever the scope: counts, no text.
        scorer, stored_idf = stored_scorer(store, embed_model, grader or os.environ.get("CRAG_GRADER") or None)
    given = {k: v for k, v in (settings or {}).items() if k in CragSettings.model_fields}
    resolved = CragSettings.resolve(
        given,
        calibration_path=calibration_path,
        scorer_name=scorer.name,
        scorer_defaults=scorer.default_thresholds,
    )
    top_k, widen = resolved.similarity_top_k, resolved.fallback_widen
    asked = None if scope is None else Scope.of(scope)
    fallback: BaseRetriever
    if retriever is None:
        bounds = asked or UNBOUNDED
        retriever = PostgresVectorRetriever(store, embed_model, top_k, scope=bounds)
        fallback = store_fallback(store, embed_model, top_k, fallback_sources, scope=bounds, widen_to=widen)
    else:
        own = retriever_scope(retriever)
        if own is None and asked is None:
            fallback = FallbackRetriever({"primary": retriever}, similarity_top_k=top_k)
        else:
            bounds = (own or UNBOUNDED).narrow(asked)
            fallback = store_fallback(store, embed_model, top_k, fallback_sources, scope=bounds, widen_to=widen)
    return StoreParts(
        store=store,
        embed_model=embed_model,
        retriever=retriever,
        fallback=fallback,
        scorer=scorer,
        postprocessors=[StoredEvidence(scorer, stored_idf), *(postprocessors or [])],
    )


def store_fallback(
    store: PostgresStore,
    embed_model: BaseEmbedding,
    similarity_top_k: int = 5,
    sources: Sequence[str] = ("fulltext", "sentence_window"),
    scope: Optional[Scope] = None,
    widen_to: str = "chunk",
) -> BaseRetriever:
    """The ``FallbackRetriever`` of the INCORRECT branch over the store: full-text search, then sentence windows
    (each sentence found widened ``widen_to`` its chunk or its window: ``fallback_widen``), each searching inside
    ``scope`` (default: the whole store)."""
    built: Dict[str, BaseRetriever] = {}
    for source in sources:
        if source in ("fulltext", "bm25"):
            built[source] = PostgresFullTextRetriever(store, similarity_top_k, scope=scope)
        elif source == "sentence_window":
            built[source] = PostgresSentenceWindowRetriever(
                store, embed_model, similarity_top_k, scope=scope, widen_to=widen_to
            )
        else:
            raise ValueError(f"unknown fallback source {source!r}: use 'fulltext' or 'sentence_window'")
    return FallbackRetriever(built, similarity_top_k=similarity_top_k)
