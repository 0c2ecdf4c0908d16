"""Engines over a persisted store: the index folder's (``load_engine``) and PostgreSQL's (``engine_from_store``,
from ``core/store_parts.py``).

Stores hold and search passages and know nothing of the loop; this module, beside ``core/builder.py``, is where
an engine is put together over one.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence, Union

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.llms import LLM

from llama_index_crag.core.engine import CorrectiveQueryEngine
from llama_index_crag.core.store_parts import store_parts
from llama_index_crag.errors import IndexFolderError
from llama_index_crag.scope import Scope, ScopeLike
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.scorers.registry import default_scorer
from llama_index_crag.stores.folder import CORPUS_STATS, LoadedIndex
from llama_index_crag.stores.postgres.store import DEFAULT_TABLE, PostgresStore


def index_scorer(loaded: LoadedIndex) -> EvidenceScorer:
    """The scorer an engine over ``loaded`` grades with: the recorded grader, else the evidence scorer, over the
    index's embedding model and with its persisted corpus statistics (``llama-crag calibrate --index`` fits it)."""
    scorer = default_scorer(loaded.embed_model, grader=loaded.manifest.get("grader"))
    if not isinstance(scorer, EvidenceScorer):  # every default (evidence, a reader cascade) weighs words by IDF
        raise IndexFolderError(f"{loaded.index_dir}: the grader {scorer.name} cannot use the index's word statistics")
    scorer.load_corpus_stats(json.loads((loaded.index_dir / CORPUS_STATS).read_text()))
    return scorer


def load_engine(loaded: LoadedIndex, llm: Optional[LLM], **settings: Any) -> CorrectiveQueryEngine:
    """The engine over a loaded index: its scorer (``index_scorer``), its calibration, and the fallback over its
    chunks."""
    scorer = index_scorer(loaded)
    return CorrectiveQueryEngine.from_defaults(
        index=loaded.index,
        nodes=loaded.nodes,
        llm=llm,
        scorer=scorer,
        embed_model=loaded.embed_model,
        calibration_path=loaded.calibration_path,
        **settings,
    )


def engine_from_store(
    store: Union[str, PostgresStore, Any],
    llm: Any = None,
    embed_model: Optional[BaseEmbedding] = None,
    scorer: Optional[RelevanceScorer] = None,
    fallback_sources: Sequence[str] = ("fulltext", "sentence_window"),
    grader: Optional[str] = None,
    table: str = DEFAULT_TABLE,
    filters: ScopeLike = None,
    **engine_kwargs: Any,
) -> CorrectiveQueryEngine:
    """The corrective engine over a PostgreSQL store, reading nothing but what each query needs.

    ``store`` is a ``postgresql://`` URL, a ``PostgresStore``, or a LlamaIndex
    ``PGVectorStore`` whose table ``llama-crag ingest --store`` (or ``ingest``) filled.
    Retrieval is pgvector's; the fallback is full-text search and sentence windows in
    PostgreSQL; grading reuses the stored embeddings and reads the IDF of the query's
    words only. Other keywords go to ``CorrectiveQueryEngine.from_defaults`` (the LLM,
    ``calibration_path``, ``CragSettings`` fields such as ``upper`` or ``enabled``).

    ``filters`` (LlamaIndex ``MetadataFilters``, their JSON, or ``{"tenant": "acme"}``) bound every search:
    the primary retrieval, full-text search and sentence windows apply them in their SQL
    (``stores.postgres.filters``), and the engine checks every candidate against them as well. A filter
    that PostgreSQL cannot apply exactly raises ``ScopeError`` here.
    """
    given = engine_kwargs.pop("retriever", None)
    parts = store_parts(
        store,
        embed_model,
        scorer,
        fallback_sources,
        grader,
        table,
        settings=engine_kwargs,
        calibration_path=engine_kwargs.get("calibration_path"),
        postprocessors=engine_kwargs.pop("node_postprocessors", None),
        retriever=given,
        scope=None if filters is None else Scope.of(filters),
    )
    if given is not None:  # the engine narrows a given retriever (or warns that it cannot) and checks its hits
        engine_kwargs["filters"] = filters
    # Otherwise the engine reads the scope from the store's retriever (its ``scope``) and checks every hit too.
    return CorrectiveQueryEngine.from_defaults(
        retriever=parts.retriever,
        llm=llm,
        scorer=parts.scorer,
        embed_model=parts.embed_model,
        fallback=parts.fallback,
        node_postprocessors=parts.postprocessors,
        **engine_kwargs,
    )
